//! The little DER that DKIM keys need and `ring` does not offer: reading which algorithm
//! a PKCS#8 key is for and how long an RSA key's modulus is (to name what a key file
//! holds before `ring` takes or refuses it), and writing an RSA public key as the
//! SubjectPublicKeyInfo a `p=` tag carries (RFC 6376 §3.6.1; `ring` gives the bare
//! PKCS#1 RSAPublicKey).
//!
//! Used by `keyfile.rs` and `keys.rs`. Pure: bytes in, bytes out; the reader trusts
//! nothing (every length is checked against what is left, no recursion) and only the
//! few fields named here are read.

/// The DER tag of a SEQUENCE.
const SEQUENCE: u8 = 0x30;
/// The DER tag of an INTEGER.
const INTEGER: u8 = 0x02;
/// The DER tag of an OCTET STRING.
const OCTET_STRING: u8 = 0x04;
/// The DER tag of an OBJECT IDENTIFIER.
const OBJECT_IDENTIFIER: u8 = 0x06;
/// The DER tag of a BIT STRING.
const BIT_STRING: u8 = 0x03;
/// The DER tag of NULL.
const NULL: u8 = 0x05;

/// The content of the OID 1.2.840.113549.1.1.1 (rsaEncryption).
pub const RSA_ENCRYPTION: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01];
/// The content of the OID 1.3.101.112 (Ed25519, RFC 8410).
pub const ED25519: &[u8] = &[0x2b, 0x65, 0x70];

/// Reads DER elements one after another from a slice.
struct Reader<'a> {
    /// What is left to read.
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    /// The content of the next element, which must have this tag.
    fn read(&mut self, tag: u8) -> Option<&'a [u8]> {
        let (&found, rest) = self.rest.split_first()?;
        if found != tag {
            return None;
        }
        let (&first, mut rest) = rest.split_first()?;
        let len = if first < 0x80 {
            usize::from(first)
        } else {
            // Long form: the low bits count the length's bytes (at most four here).
            let count = usize::from(first & 0x7f);
            if count == 0 || count > 4 {
                return None;
            }
            let (bytes, after) = rest.split_at_checked(count)?;
            rest = after;
            bytes.iter().fold(0usize, |n, &b| (n << 8) | usize::from(b))
        };
        let (content, after) = rest.split_at_checked(len)?;
        self.rest = after;
        Some(content)
    }
}

/// The algorithm OID (its content bytes) and the private key (the OCTET STRING's
/// content) of a PKCS#8 PrivateKeyInfo; `None` when the bytes are no such structure.
pub fn pkcs8_parts(der: &[u8]) -> Option<(&[u8], &[u8])> {
    let info = Reader { rest: der }.read(SEQUENCE)?;
    let mut fields = Reader { rest: info };
    fields.read(INTEGER)?;
    let algorithm = fields.read(SEQUENCE)?;
    let oid = Reader { rest: algorithm }.read(OBJECT_IDENTIFIER)?;
    let key = fields.read(OCTET_STRING)?;
    Some((oid, key))
}

/// The length in bits of the modulus of a PKCS#1 RSAPrivateKey; `None` when the bytes
/// are no such structure.
pub fn rsa_modulus_bits(der: &[u8]) -> Option<usize> {
    let key = Reader { rest: der }.read(SEQUENCE)?;
    let mut fields = Reader { rest: key };
    fields.read(INTEGER)?;
    let modulus = fields.read(INTEGER)?;
    // A positive INTEGER may start with zero bytes; the length counts from the first
    // bit that is set.
    let start = modulus.iter().position(|&b| b != 0)?;
    let top = modulus[start];
    Some((modulus.len() - start - 1) * 8 + (8 - top.leading_zeros() as usize))
}

/// Appends one DER element: tag, definite length, content.
fn element(tag: u8, content: &[u8], out: &mut Vec<u8>) {
    out.push(tag);
    let len = content.len();
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes = len.to_be_bytes();
        let skip = bytes
            .iter()
            .position(|&b| b != 0)
            .unwrap_or(bytes.len() - 1);
        out.push(0x80 | (bytes.len() - skip) as u8);
        out.extend_from_slice(&bytes[skip..]);
    }
    out.extend_from_slice(content);
}

/// The SubjectPublicKeyInfo of an RSA public key given as a PKCS#1 RSAPublicKey:
/// `SEQUENCE { SEQUENCE { rsaEncryption, NULL }, BIT STRING (no unused bits) }`.
pub fn rsa_spki(rsa_public_key: &[u8]) -> Vec<u8> {
    let mut algorithm = Vec::with_capacity(15);
    element(OBJECT_IDENTIFIER, RSA_ENCRYPTION, &mut algorithm);
    element(NULL, &[], &mut algorithm);
    let mut bits = Vec::with_capacity(rsa_public_key.len() + 1);
    bits.push(0);
    bits.extend_from_slice(rsa_public_key);
    let mut body = Vec::with_capacity(bits.len() + 24);
    element(SEQUENCE, &algorithm, &mut body);
    element(BIT_STRING, &bits, &mut body);
    let mut out = Vec::with_capacity(body.len() + 4);
    element(SEQUENCE, &body, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;

    use super::*;

    /// RFC 8463 Appendix A.2's RSA public key record (`p=` of selector `test`).
    const RFC_8463_SPKI: &str = "MIGfMA0GCSqGSIb3DQEBAQUAA4GNADCBiQKBgQDkHlOQoBTzWRiGs5V6NpP3idY6Wk08a5\
        qhdR6wy5bdOKb2jLQiY/J16JYi0Qvx/byYzCNb3W91y3FutACDfzwQ/BC/e/8uBsCR+yz1Lxj+PL6lHvqMKrM3rG4hst\
        T5QjvHO9PzoxZyVYLzBfO2EeC3Ip3G+2kryOTIKT+l/K4w3QIDAQAB";

    #[test]
    fn an_rsa_public_key_wrapped_as_spki_is_the_rfcs_published_record() {
        let spki = STANDARD.decode(RFC_8463_SPKI).unwrap();
        // The RSAPublicKey is the BIT STRING's content after its unused-bits byte.
        let outer = Reader { rest: &spki }.read(SEQUENCE).unwrap();
        let mut r = Reader { rest: outer };
        r.read(SEQUENCE).unwrap();
        let bits = r.read(BIT_STRING).unwrap();
        assert_eq!(bits[0], 0);
        assert_eq!(rsa_spki(&bits[1..]), spki);
    }

    #[test]
    fn long_lengths_are_written_in_as_few_bytes_as_they_need() {
        let mut out = Vec::new();
        element(OCTET_STRING, &[7; 0x7f], &mut out);
        assert_eq!(&out[..2], [0x04, 0x7f]);
        out.clear();
        element(OCTET_STRING, &[7; 0x80], &mut out);
        assert_eq!(&out[..3], [0x04, 0x81, 0x80]);
        out.clear();
        element(OCTET_STRING, &[7; 0x1234], &mut out);
        assert_eq!(&out[..4], [0x04, 0x82, 0x12, 0x34]);
        assert_eq!(out.len(), 4 + 0x1234);
        let mut r = Reader { rest: &out };
        assert_eq!(r.read(OCTET_STRING).map(<[u8]>::len), Some(0x1234));
    }

    #[test]
    fn the_reader_refuses_short_long_and_mistagged_elements() {
        for bad in [
            &[][..],
            &[0x30],
            &[0x30, 0x05, 0x01],
            &[0x30, 0x85, 1, 1, 1, 1, 1],
            &[0x30, 0x80],
            &[0x30, 0x82, 0xff],
            &[0x30, 0x84, 0xff, 0xff, 0xff, 0xff, 0x00],
        ] {
            assert_eq!(Reader { rest: bad }.read(SEQUENCE), None, "{bad:?}");
        }
        assert_eq!(
            Reader {
                rest: &[0x02, 0x00]
            }
            .read(SEQUENCE),
            None
        );
        assert_eq!(pkcs8_parts(b"not der"), None);
        assert_eq!(rsa_modulus_bits(&[0x30, 0x03, 0x02, 0x01, 0x00]), None);
    }

    #[test]
    fn the_parts_of_a_pkcs8_key_and_an_rsa_modulus_length_are_read() {
        // RFC 8410's Ed25519 PrivateKeyInfo prefix, then a 32-byte seed.
        let mut ed = vec![
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
            0x04, 0x20,
        ];
        ed.extend_from_slice(&[9; 32]);
        let (oid, key) = pkcs8_parts(&ed).unwrap();
        assert_eq!(oid, ED25519);
        assert_eq!(key.len(), 34);
        // RSAPrivateKey { version 0, modulus 0x00 0x81 0x00… (a 2056-bit integer's
        // leading zero byte and 257 bytes) }: 2056 bits.
        let mut modulus = vec![0x00, 0x81];
        modulus.extend_from_slice(&[0; 256]);
        let mut fields = Vec::new();
        element(INTEGER, &[0], &mut fields);
        element(INTEGER, &modulus, &mut fields);
        let mut key = Vec::new();
        element(SEQUENCE, &fields, &mut key);
        assert_eq!(rsa_modulus_bits(&key), Some(2056));
    }
}
