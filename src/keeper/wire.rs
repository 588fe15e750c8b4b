//! The keeper's wire: Unix `SOCK_SEQPACKET` socket pairs (each message arrives whole, and
//! a peer's end of file is a zero-length read), messages of NUL-separated fields, and
//! file descriptors passed along with a message (`SCM_RIGHTS`). `std` has no sendmsg
//! with descriptors, so this is libc; nothing here knows what the messages mean.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

/// The largest message either side sends or accepts. A request carries a message's
/// envelope in its environment; the kernel's default socket buffer (about 208 KiB) is
/// the real bound of one datagram, and a larger one fails to send (EMSGSIZE).
pub const MAX_MESSAGE: usize = 256 * 1024;

/// The most descriptors one message carries.
pub const MAX_FDS: usize = 4;

/// A connected pair of `SOCK_SEQPACKET` sockets, both close-on-exec.
pub fn pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: fds has room for the two descriptors socketpair writes.
    let r = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair succeeded: both descriptors are open and ours alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A pipe, both ends close-on-exec: (read end, write end).
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: fds has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded: both descriptors are open and ours alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Joins fields into one message.
pub fn message(fields: &[&[u8]]) -> Vec<u8> {
    fields.join(&0u8)
}

/// Splits a message into its fields.
pub fn fields(message: &[u8]) -> Vec<&[u8]> {
    message.split(|&b| b == 0).collect()
}

/// Sends one message with `fds` (which stay open here: the kernel gives the peer its
/// own copies). Never raises SIGPIPE: a peer gone is an `EPIPE` error.
pub fn send(sock: BorrowedFd<'_>, message: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    assert!(fds.len() <= MAX_FDS, "too many descriptors for one message");
    let mut iov = libc::iovec {
        iov_base: message.as_ptr() as *mut libc::c_void,
        iov_len: message.len(),
    };
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(raw.as_slice()) as u32) } as usize;
    let mut control = vec![0u8; space.max(1)];
    // SAFETY: msghdr is plain data; every pointer set below stays valid for the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer has room for one header with the descriptors
        // (CMSG_SPACE of their size), so CMSG_FIRSTHDR is non-null and CMSG_DATA
        // points inside it.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(raw.as_slice()) as u32) as _;
            std::ptr::copy_nonoverlapping(
                raw.as_ptr(),
                libc::CMSG_DATA(cmsg).cast::<RawFd>(),
                raw.len(),
            );
        }
    }
    loop {
        // SAFETY: msg describes valid buffers for the duration of the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// What a receive brought.
#[derive(Debug)]
pub enum Received {
    /// A message and the descriptors that came with it (close-on-exec here).
    Message(Vec<u8>, Vec<OwnedFd>),
    /// The peer closed its end.
    Closed,
}

/// Receives one message, blocking. A message cut short (longer than [`MAX_MESSAGE`])
/// or carrying more than [`MAX_FDS`] descriptors is an `InvalidData` error, its
/// descriptors closed.
pub fn recv(sock: BorrowedFd<'_>) -> io::Result<Received> {
    thread_local! {
        // One buffer per thread, made (and zeroed) once: a fresh one of this size per
        // message costs a memset of a quarter megabyte each time.
        static BUF: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0u8; MAX_MESSAGE]);
    }
    BUF.with(|b| recv_into(sock, &mut b.borrow_mut()))
}

/// [`recv`] into `buf` (at least [`MAX_MESSAGE`] long); the message is copied out.
fn recv_into(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<Received> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) };
    let mut control = vec![0u8; space as usize];
    // SAFETY: msghdr is plain data; every pointer set below stays valid for the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    let n = loop {
        // SAFETY: msg describes valid buffers for the duration of the call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled msg's control buffer; CMSG_FIRSTHDR/NXTHDR walk it
    // within msg_controllen, and each SCM_RIGHTS payload holds descriptors now open in
    // this process, which become ours.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a message or its descriptors were cut short",
        ));
    }
    if n == 0 && fds.is_empty() {
        return Ok(Received::Closed);
    }
    Ok(Received::Message(buf[..n].to_vec(), fds))
}

/// Waits up to `timeout` (forever for `None`) for `fd` to become readable (or to hang
/// up); `false` when the time ran out.
pub fn wait_readable(fd: BorrowedFd<'_>, timeout: Option<std::time::Duration>) -> io::Result<bool> {
    let deadline = timeout.map(|t| std::time::Instant::now() + t);
    loop {
        let ms = match deadline {
            None => -1,
            Some(d) => {
                let left = d.saturating_duration_since(std::time::Instant::now());
                // Round up, so that a wait never ends a little early.
                left.as_millis().min(i32::MAX as u128) as i32
                    + i32::from(left.subsec_nanos() % 1_000_000 != 0)
            }
        };
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: pfd is one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r > 0 {
            return Ok(true);
        }
        if r == 0 {
            return Ok(false);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    #[test]
    fn a_message_and_its_descriptors_arrive_whole_and_end_of_file_is_seen() {
        let (a, b) = pair().unwrap();
        let (r, w) = pipe().unwrap();
        send(a.as_fd(), &message(&[b"RUN", b"x=1", b""]), &[w.as_fd()]).unwrap();
        drop(w);
        let Received::Message(m, mut fds) = recv(b.as_fd()).unwrap() else {
            panic!("no message")
        };
        assert_eq!(fields(&m), [&b"RUN"[..], b"x=1", b""]);
        assert_eq!(fds.len(), 1);
        let mut w2 = std::fs::File::from(fds.pop().unwrap());
        w2.write_all(b"through").unwrap();
        drop(w2);
        let mut got = String::new();
        std::fs::File::from(r).read_to_string(&mut got).unwrap();
        assert_eq!(got, "through");
        assert!(!wait_readable(b.as_fd(), Some(std::time::Duration::from_millis(10))).unwrap());
        drop(a);
        assert!(wait_readable(b.as_fd(), Some(std::time::Duration::from_secs(5))).unwrap());
        assert!(matches!(recv(b.as_fd()).unwrap(), Received::Closed));
    }

    #[test]
    fn a_message_too_large_for_the_socket_is_refused_by_send() {
        let (a, _b) = pair().unwrap();
        let big = vec![b'x'; 4 * MAX_MESSAGE];
        assert!(send(a.as_fd(), &big, &[]).is_err());
    }
}
