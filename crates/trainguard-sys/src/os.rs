//! The OS calls trainguard makes: an address-space limit and glibc allocator tuning for the CPU
//! memory cap, and read-only memory maps of token files.
use std::fs::File;

/// Makes glibc serve every block over 128 KiB with its own `mmap` (fixed threshold, so freed
/// blocks go back to the OS at once) from a single arena (no 64 MiB per-thread reservations).
pub fn malloc_for_exact_accounting() {
    // SAFETY: mallopt only tunes glibc's allocator; both values are valid for these options.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Returns the free memory at the top of glibc's heap to the OS (`malloc_trim(0)`), so that a
/// later peak resident size counts what is allocated after this point.
pub fn release_free_heap() {
    // SAFETY: malloc_trim only releases free memory; it touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The soft `RLIMIT_AS` of this process (`RLIM_INFINITY` when none), if it can be read.
pub fn address_space_limit() -> Option<u64> {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: plain syscall writing into a valid struct.
    (unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut rl) } == 0).then_some(rl.rlim_cur)
}

/// Sets the soft `RLIMIT_AS` (address space) of this process to `bytes`.
pub fn limit_address_space(bytes: u64) -> std::io::Result<()> {
    let rl = libc::rlimit { rlim_cur: bytes, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: plain syscall with a valid struct; lowering the soft limit needs no privilege.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &rl) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Maps `file` read-only.
pub fn map_readonly(file: &File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the map is read-only; a file truncated by another process while mapped would
    // fault, as with numpy.memmap in nanoGPT: training data is not edited mid-run.
    unsafe { memmap2::Mmap::map(file) }
}

/// Ends the process at once with `code`, without running atexit handlers or static destructors
/// (`_exit`): libtorch's destructors crash when another thread is still inside libtorch.
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit takes any status and does not return.
    unsafe { libc::_exit(code) }
}

/// Ends the process with `code` once C's output buffers are written (`fflush(NULL)`), without
/// static destructors ([`exit_now`]): at the end of a command, detached threads may still be
/// inside libtorch (a rank's heartbeat adding to the group's store, a store request left
/// behind), and `exit` then crashed a rank whose work was done (SIGSEGV, seen in CI under a
/// memory cap). Rust's stdout is the caller's to flush.
pub fn end_process(code: i32) -> ! {
    // SAFETY: fflush(NULL) flushes every open C output stream; it takes no pointer of ours.
    unsafe {
        libc::fflush(std::ptr::null_mut());
    }
    exit_now(code)
}

/// This process's real user id.
pub fn user_id() -> u32 {
    // SAFETY: getuid cannot fail.
    unsafe { libc::getuid() }
}

/// The id of this process's parent.
pub fn parent_pid() -> u32 {
    // SAFETY: getppid cannot fail.
    unsafe { libc::getppid() as u32 }
}
