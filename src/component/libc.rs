//! Three C library functions, defined here so the linker does not take wasi-libc's.
//!
//! Rust's std reaches wasi-libc only from its default panic hook: it reads
//! `RUST_BACKTRACE` (`getenv`, whose environment setup can call `wasi:cli/exit`) and
//! writes the message to stderr (`write`/`writev`, whose descriptor table asks
//! `wasi:cli/terminal-*` whether stdio is a terminal). Those imports are outside
//! `wasi:http/proxy`, and strict hosts refuse a component that has them. Here stdout and
//! stderr go straight to `wasi:cli/stdout` and `wasi:cli/stderr`, and `getenv` finds
//! nothing (the gateway reads its environment through `wasi:cli/environment`). The
//! import check in host-test's component tests proves the result.

use super::wasi::cli::{stderr, stdout};
use core::ffi::c_char;

/// `struct iovec` of wasi-libc (wasm32).
#[repr(C)]
pub struct IoVec {
    base: *const u8,
    len: usize,
}

fn write_fd(fd: i32, data: &[u8]) -> isize {
    let stream = match fd {
        1 => stdout::get_stdout(),
        2 => stderr::get_stderr(),
        _ => return -1,
    };
    let written = data.chunks(4096).all(|chunk| stream.blocking_write_and_flush(chunk).is_ok());
    if written {
        isize::try_from(data.len()).unwrap_or(isize::MAX)
    } else {
        -1
    }
}

/// # Safety
/// `buf` points to `len` readable bytes (the C contract of `write`).
#[no_mangle]
pub unsafe extern "C" fn write(fd: i32, buf: *const u8, len: usize) -> isize {
    if buf.is_null() {
        return if len == 0 { 0 } else { -1 };
    }
    // SAFETY: the caller passes a buffer of `len` bytes.
    write_fd(fd, unsafe { core::slice::from_raw_parts(buf, len) })
}

/// # Safety
/// `iov` points to `count` iovecs, each pointing to `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn writev(fd: i32, iov: *const IoVec, count: i32) -> isize {
    let Ok(count) = usize::try_from(count) else { return -1 };
    if iov.is_null() {
        return if count == 0 { 0 } else { -1 };
    }
    // SAFETY: the caller passes `count` iovecs.
    let vecs = unsafe { core::slice::from_raw_parts(iov, count) };
    let mut total = 0isize;
    for v in vecs.iter().filter(|v| v.len > 0 && !v.base.is_null()) {
        // SAFETY: each iovec describes `len` readable bytes.
        let n = write_fd(fd, unsafe { core::slice::from_raw_parts(v.base, v.len) });
        if n < 0 {
            return n;
        }
        total = total.saturating_add(n);
    }
    total
}

/// # Safety
/// Always safe: the name is not read.
#[no_mangle]
pub unsafe extern "C" fn getenv(_name: *const c_char) -> *mut c_char {
    core::ptr::null_mut()
}
