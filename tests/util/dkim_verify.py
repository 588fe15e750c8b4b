"""Checks every DKIM-Signature of a message with dkimpy (Debian's python3-dkim), an
implementation independent of Pepsi's signer.

Usage: /usr/bin/python3 dkim_verify.py RECORDS < MESSAGE

RECORDS is a JSON object mapping DNS names ("sel._domainkey.example.org") to the text of
their TXT record: the only DNS the check sees. Prints a JSON array with one entry per
signature, top down: true when it verifies, else the reason it does not.
"""
import json
import sys

try:
    import dkim
    import nacl.signing  # noqa: F401 (dkimpy needs it for Ed25519)
except ImportError as e:
    print("dkimpy is not usable (%s): install python3-dkim and python3-nacl" % e)
    sys.exit(3)

records = {k.lower().rstrip("."): v for k, v in json.loads(sys.argv[1]).items()}


def txt(name, timeout=5):
    name = name.decode("ascii") if isinstance(name, bytes) else name
    record = records.get(name.lower().rstrip("."))
    return record.encode("ascii") if record is not None else None


message = sys.stdin.buffer.read()
checker = dkim.DKIM(message)
count = sum(1 for name, _ in checker.headers if name.lower() == b"dkim-signature")
results = []
for i in range(count):
    try:
        ok = dkim.DKIM(message).verify(idx=i, dnsfunc=txt)
        results.append(True if ok else "does not verify")
    except dkim.DKIMException as e:
        results.append("refused: %s" % e)
print(json.dumps(results))
