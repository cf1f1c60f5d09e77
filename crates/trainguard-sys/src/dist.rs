//! Thin wrapper over `dist.cpp`: a c10d process group (TCPStore + Gloo) owned by Rust.
use super::ShimError;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use tch::Tensor;

extern "C" {
    fn tg_pg_nccl_built() -> c_int;
    fn tg_pg_new(
        backend: c_int,
        host: *const c_char,
        port: c_int,
        rank: c_int,
        world: c_int,
        host_store: c_int,
        timeout_ms: i64,
        prefix: *const c_char,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
    fn tg_pg_allreduce(
        group: *mut c_void,
        tensor: *mut c_void,
        op: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_pg_broadcast(
        group: *mut c_void,
        tensor: *mut c_void,
        root: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_pg_reduce_scatter(
        group: *mut c_void,
        output: *mut c_void,
        input: *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_pg_all_gather(
        group: *mut c_void,
        output: *mut c_void,
        input: *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_pg_broadcast_start(
        group: *mut c_void,
        tensor: *mut c_void,
        root: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
    fn tg_pg_reduce_start(
        group: *mut c_void,
        tensor: *mut c_void,
        root: c_int,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
    fn tg_work_wait(work: *mut c_void, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_pg_barrier(group: *mut c_void, err: *mut c_char, err_len: usize) -> c_int;
    fn tg_buckets_new(
        group: *mut c_void,
        params: *mut *mut c_void,
        bucket: *const i64,
        offset: *const i64,
        hooked: *const u8,
        n: usize,
        flats: *mut *mut c_void,
        order: *const i64,
        n_buckets: usize,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
    fn tg_buckets_arm(
        buckets: *mut c_void,
        sums: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_buckets_finish(
        buckets: *mut c_void,
        grads: *mut *mut c_void,
        started_early: *mut usize,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_reduces_new(
        group: *mut c_void,
        params: *mut *mut c_void,
        hooked: *const u8,
        owner: *const i64,
        numel: *const i64,
        order: *const i64,
        n: usize,
        chunk: i64,
        rank: i64,
        scratch: *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
    fn tg_buckets_arrived(buckets: *mut c_void, out: *mut u8, n: usize);
    fn tg_buckets_free(buckets: *mut c_void);
    fn tg_pg_free(group: *mut c_void);
    fn tg_store_new(
        host: *const c_char,
        port: c_int,
        timeout_ms: i64,
        prefix: *const c_char,
        err: *mut c_char,
        err_len: usize,
    ) -> *mut c_void;
    fn tg_store_add(
        store: *mut c_void,
        key: *const c_char,
        delta: i64,
        value: *mut i64,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;
    fn tg_store_free(store: *mut c_void);
}

const ERR_LEN: usize = 4096;

fn message(err: &[u8]) -> String {
    CStr::from_bytes_until_nul(err).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default()
}

fn check(code: c_int, err: &[u8]) -> Result<(), ShimError> {
    if code == 0 {
        Ok(())
    } else {
        Err(ShimError::Torch(message(err)))
    }
}

/// Whether this binary's c10d shim includes ProcessGroupNCCL.
pub fn nccl_built() -> bool {
    // SAFETY: no arguments, no state.
    unsafe { tg_pg_nccl_built() == 1 }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Gloo = 0,
    Nccl = 1,
}

#[derive(Debug, Clone, Copy)]
pub enum ReduceOp {
    Sum = 0,
    Max = 1,
}

/// A Gloo process group. Dropping it leaves the group.
pub struct ProcessGroup {
    handle: *mut c_void,
}

// SAFETY: the handle is only used through &self/&mut self from one thread at a time; c10d's
// process group is itself thread-safe.
unsafe impl Send for ProcessGroup {}

impl ProcessGroup {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        backend: Backend,
        host: &str,
        port: u16,
        rank: usize,
        world: usize,
        host_store: bool,
        timeout_ms: u64,
        prefix: &str,
    ) -> Result<Self, ShimError> {
        let host = CString::new(host).map_err(|_| ShimError::Torch("host contains NUL".into()))?;
        let prefix = CString::new(prefix).map_err(|_| ShimError::Torch("prefix contains NUL".into()))?;
        let mut err = [0u8; ERR_LEN];
        // SAFETY: both strings are NUL-terminated and outlive the call; `err` is ERR_LEN bytes.
        let handle = unsafe {
            tg_pg_new(
                backend as c_int,
                host.as_ptr(),
                port as c_int,
                rank as c_int,
                world as c_int,
                host_store as c_int,
                timeout_ms as i64,
                prefix.as_ptr(),
                err.as_mut_ptr().cast(),
                ERR_LEN,
            )
        };
        if handle.is_null() {
            return Err(ShimError::Torch(message(&err)));
        }
        Ok(Self { handle })
    }

    /// In-place all-reduce of one tensor across ranks.
    pub fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<(), ShimError> {
        let mut err = [0u8; ERR_LEN];
        // SAFETY: `tensor` is a live tch handle (an at::Tensor*); the call blocks until done.
        check(
            unsafe {
                tg_pg_allreduce(
                    self.handle,
                    tensor.as_mut_ptr().cast(),
                    op as c_int,
                    err.as_mut_ptr().cast(),
                    ERR_LEN,
                )
            },
            &err,
        )
    }

    pub fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<(), ShimError> {
        let mut err = [0u8; ERR_LEN];
        // SAFETY: as in all_reduce.
        check(
            unsafe {
                tg_pg_broadcast(
                    self.handle,
                    tensor.as_mut_ptr().cast(),
                    root as c_int,
                    err.as_mut_ptr().cast(),
                    ERR_LEN,
                )
            },
            &err,
        )
    }

    /// `output` (n elements) = the sum over ranks of this rank's n-element piece of their
    /// `input` (world × n elements, contiguous, same dtype and device as `output`).
    pub fn reduce_scatter(&self, output: &mut Tensor, input: &mut Tensor) -> Result<(), ShimError> {
        let mut err = [0u8; ERR_LEN];
        // SAFETY: both are live tch handles (at::Tensor*); the call blocks until done.
        check(
            unsafe {
                tg_pg_reduce_scatter(
                    self.handle,
                    output.as_mut_ptr().cast(),
                    input.as_mut_ptr().cast(),
                    err.as_mut_ptr().cast(),
                    ERR_LEN,
                )
            },
            &err,
        )
    }

    /// `output` (world × n elements) = every rank's `input` (n elements), rank after rank.
    pub fn all_gather(&self, output: &mut Tensor, input: &mut Tensor) -> Result<(), ShimError> {
        let mut err = [0u8; ERR_LEN];
        // SAFETY: as in reduce_scatter.
        check(
            unsafe {
                tg_pg_all_gather(
                    self.handle,
                    output.as_mut_ptr().cast(),
                    input.as_mut_ptr().cast(),
                    err.as_mut_ptr().cast(),
                    ERR_LEN,
                )
            },
            &err,
        )
    }

    /// [`ProcessGroup::broadcast`] started, not waited for: the collective runs meanwhile (on
    /// Gloo's threads, on NCCL's stream) and [`Work::wait`] completes it. The work holds the
    /// tensor until then.
    pub fn broadcast_start(&self, tensor: &mut Tensor, root: usize) -> Result<Work, ShimError> {
        self.start(tg_pg_broadcast_start, tensor, root)
    }

    /// `tensor` summed over the ranks into `root`'s (the others' are left undefined), started
    /// and not waited for, as [`ProcessGroup::broadcast_start`].
    pub fn reduce_start(&self, tensor: &mut Tensor, root: usize) -> Result<Work, ShimError> {
        self.start(tg_pg_reduce_start, tensor, root)
    }

    fn start(
        &self,
        collective: unsafe extern "C" fn(*mut c_void, *mut c_void, c_int, *mut c_char, usize) -> *mut c_void,
        tensor: &mut Tensor,
        root: usize,
    ) -> Result<Work, ShimError> {
        let mut err = [0u8; ERR_LEN];
        // SAFETY: as in all_reduce; the returned work keeps its own reference to the tensor.
        let handle = unsafe {
            collective(
                self.handle,
                tensor.as_mut_ptr().cast(),
                root as c_int,
                err.as_mut_ptr().cast(),
                ERR_LEN,
            )
        };
        if handle.is_null() {
            return Err(ShimError::Torch(message(&err)));
        }
        Ok(Work { handle })
    }

    pub fn barrier(&self) -> Result<(), ShimError> {
        let mut err = [0u8; ERR_LEN];
        // SAFETY: the handle is live until drop.
        check(unsafe { tg_pg_barrier(self.handle, err.as_mut_ptr().cast(), ERR_LEN) }, &err)
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // SAFETY: created by tg_pg_new, freed once.
        unsafe { tg_pg_free(self.handle) }
    }
}

/// A collective started on a [`ProcessGroup`] and not yet complete. Dropped unwaited, it is
/// waited for (its outcome unread): the peers run it to its end whatever this rank does next,
/// so the next collective must come after it here too.
pub struct Work {
    handle: *mut c_void,
}

// SAFETY: c10d's work is waited for from whichever thread holds it, once.
unsafe impl Send for Work {}

impl Work {
    /// Blocks until the collective completed on this rank.
    pub fn wait(mut self) -> Result<(), ShimError> {
        let handle = std::mem::replace(&mut self.handle, std::ptr::null_mut());
        let mut err = [0u8; ERR_LEN];
        // SAFETY: a live handle from a tg_pg_*_start, waited for and freed once.
        check(unsafe { tg_work_wait(handle, err.as_mut_ptr().cast(), ERR_LEN) }, &err)
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            let mut err = [0u8; ERR_LEN];
            // SAFETY: as in wait; the handle is nulled there, so this runs only when unwaited.
            let _ = unsafe { tg_work_wait(self.handle, err.as_mut_ptr().cast(), ERR_LEN) };
        }
    }
}

/// Where a parameter's gradient goes in [`OverlappedBuckets`]: bucket, offset in it, and whether a
/// hook sends it from inside backward (a parameter of a block, whose gradient backward makes
/// once); the others are copied in by [`OverlappedBuckets::finish`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BucketSlot {
    pub bucket: usize,
    pub offset: i64,
    pub hooked: bool,
}

/// The replicated gradient all-reduce started from inside backward (`dist.overlap`): armed for
/// the last micro-step, a hook on each hooked parameter adds its gradient to the earlier
/// micro-steps' sum straight into its bucket, and each bucket whose parameters all arrived is
/// all-reduced at once, the buckets starting in a fixed order on every rank. [`Self::finish`]
/// starts the rest and waits for all. The hooks stay on the parameters (a tensor's hooks cannot
/// be taken off without growing its list each step); freed, the buckets leave them inert.
pub struct OverlappedBuckets {
    handle: *mut c_void,
    n_params: usize,
}

// SAFETY: the C++ side locks its state for every call and every hook.
unsafe impl Send for OverlappedBuckets {}

/// Handles of `tensors`, for a C array of at::Tensor*.
fn handles(tensors: &[Tensor]) -> Vec<*mut c_void> {
    tensors.iter().map(|t| t.as_ptr() as *mut c_void).collect()
}

impl ProcessGroup {
    /// Buckets `flats` (fp32, contiguous, one dimension) for `params`, parameter i's gradient at
    /// `slots[i]`; buckets start in `order` (a permutation of the buckets).
    pub fn overlapped_buckets(
        &self,
        params: &[Tensor],
        slots: &[BucketSlot],
        flats: &[Tensor],
        order: &[usize],
    ) -> Result<OverlappedBuckets, ShimError> {
        let bad = |why: String| Err(ShimError::Torch(format!("overlapped buckets: {why}")));
        if slots.len() != params.len() {
            return bad(format!("{} slots for {} parameters", slots.len(), params.len()));
        }
        let mut sorted = order.to_vec();
        sorted.sort_unstable();
        if sorted != (0..flats.len()).collect::<Vec<_>>() {
            return bad(format!("order {order:?} is not a permutation of {} buckets", flats.len()));
        }
        for (i, (slot, p)) in slots.iter().zip(params).enumerate() {
            let room = flats.get(slot.bucket).map_or(0, |f| f.numel() as i64);
            if slot.offset < 0 || slot.offset + p.numel() as i64 > room {
                return bad(format!("parameter {i} does not fit in bucket {}", slot.bucket));
            }
        }
        let bucket: Vec<i64> = slots.iter().map(|s| s.bucket as i64).collect();
        let offset: Vec<i64> = slots.iter().map(|s| s.offset).collect();
        let hooked: Vec<u8> = slots.iter().map(|s| u8::from(s.hooked)).collect();
        let order: Vec<i64> = order.iter().map(|&k| k as i64).collect();
        let (mut params, mut flats) = (handles(params), handles(flats));
        let mut err = [0u8; ERR_LEN];
        // SAFETY: every array holds `n` or `n_buckets` entries (checked above), the tensors are
        // live tch handles that C++ copies (a reference each), and the indices are in range.
        let handle = unsafe {
            tg_buckets_new(
                self.handle,
                params.as_mut_ptr(),
                bucket.as_ptr(),
                offset.as_ptr(),
                hooked.as_ptr(),
                params.len(),
                flats.as_mut_ptr(),
                order.as_ptr(),
                flats.len(),
                err.as_mut_ptr().cast(),
                ERR_LEN,
            )
        };
        if handle.is_null() {
            return Err(ShimError::Torch(message(&err)));
        }
        Ok(OverlappedBuckets { handle, n_params: slots.len() })
    }

    /// `dist.shard: gradients` under `dist.overlap`: parameter i's gradient summed into rank
    /// `reduce.owners[i]`'s, in place, in pieces of `reduce.chunk` elements (c10d reduce), the
    /// `hooked` ones from inside backward; parameters start in `reduce.order` (a permutation).
    /// `reduce.scratch` (fp32, at least a piece) is what a rank without a gradient sends. The
    /// same [`OverlappedBuckets`] calls drive it, with no bucket memory.
    pub fn overlapped_reduces(
        &self,
        params: &[Tensor],
        hooked: &[bool],
        reduce: &OwnerReduces,
    ) -> Result<OverlappedBuckets, ShimError> {
        let n = params.len();
        let bad = |why: String| Err(ShimError::Torch(format!("overlapped reduces: {why}")));
        if [hooked.len(), reduce.owners.len(), reduce.numels.len(), reduce.order.len()] != [n; 4] {
            return bad(format!("{n} parameters, and hooks, owners, sizes or order of another length"));
        }
        let mut sorted = reduce.order.clone();
        sorted.sort_unstable();
        if sorted != (0..n).collect::<Vec<_>>() {
            return bad(format!("order {:?} is not a permutation of {n} parameters", reduce.order));
        }
        let piece = reduce.chunk.max(1);
        if reduce.scratch.kind() != tch::Kind::Float || (reduce.scratch.numel() as i64) < piece {
            return bad(format!("the scratch must be fp32 and hold a piece of {piece} elements"));
        }
        let hooked: Vec<u8> = hooked.iter().map(|&h| u8::from(h)).collect();
        let owner: Vec<i64> = reduce.owners.iter().map(|&r| r as i64).collect();
        let order: Vec<i64> = reduce.order.iter().map(|&i| i as i64).collect();
        let mut params = handles(params);
        let mut err = [0u8; ERR_LEN];
        // SAFETY: every array holds `n` entries (checked above), the tensors are live tch
        // handles that C++ copies (a reference each), and the indices are in range.
        let handle = unsafe {
            tg_reduces_new(
                self.handle,
                params.as_mut_ptr(),
                hooked.as_ptr(),
                owner.as_ptr(),
                reduce.numels.as_ptr(),
                order.as_ptr(),
                n,
                piece,
                reduce.rank as i64,
                reduce.scratch.as_ptr() as *mut c_void,
                err.as_mut_ptr().cast(),
                ERR_LEN,
            )
        };
        if handle.is_null() {
            return Err(ShimError::Torch(message(&err)));
        }
        Ok(OverlappedBuckets { handle, n_params: n })
    }
}

/// Where [`ProcessGroup::overlapped_reduces`] sends each parameter's gradient.
pub struct OwnerReduces {
    /// Per parameter: the rank that receives its sum, and its elements.
    pub owners: Vec<usize>,
    pub numels: Vec<i64>,
    /// The parameters in the order their reduces start, the same on every rank.
    pub order: Vec<usize>,
    /// Elements per collective.
    pub chunk: i64,
    pub rank: usize,
    pub scratch: Tensor,
}

impl OverlappedBuckets {
    /// Arms the hooks for the next backward: `sums` (one per parameter, the earlier
    /// micro-steps' gradients; none on the first) are added to the gradients on the way.
    pub fn arm(&self, sums: Option<&[Tensor]>) -> Result<(), ShimError> {
        let mut sums = self.per_parameter(sums, "sums")?;
        let mut err = [0u8; ERR_LEN];
        // SAFETY: one entry (a live tensor or null) per parameter the buckets were made for.
        check(
            unsafe { tg_buckets_arm(self.handle, sums.as_mut_ptr(), err.as_mut_ptr().cast(), ERR_LEN) },
            &err,
        )
    }

    /// Ends the attempt: each parameter no hook sent is copied from `grads` (none on a rank
    /// whose backward failed: its buckets are reduced as they are, only to keep the ranks in
    /// step), every bucket not started is, and all are waited for. Returns how many buckets
    /// had started from inside backward.
    pub fn finish(&self, grads: Option<&[Tensor]>) -> Result<usize, ShimError> {
        let mut grads = self.per_parameter(grads, "gradients")?;
        let mut err = [0u8; ERR_LEN];
        let mut early = 0usize;
        // SAFETY: one entry (a live tensor or null) per parameter the buckets were made for.
        let code = unsafe {
            tg_buckets_finish(self.handle, grads.as_mut_ptr(), &mut early, err.as_mut_ptr().cast(), ERR_LEN)
        };
        check(code, &err).map(|()| early)
    }

    /// Which parameters' gradients a hook took in the armed backward: theirs are on their way
    /// already, and the caller must not write them.
    pub fn arrived(&self) -> Vec<bool> {
        let mut out = vec![0u8; self.n_params];
        // SAFETY: `out` holds one byte per parameter the buckets were made for.
        unsafe { tg_buckets_arrived(self.handle, out.as_mut_ptr(), out.len()) };
        out.into_iter().map(|b| b != 0).collect()
    }

    /// One handle a parameter for C++: `tensors`' (as many as the parameters), or nulls.
    fn per_parameter(&self, tensors: Option<&[Tensor]>, what: &str) -> Result<Vec<*mut c_void>, ShimError> {
        match tensors {
            Some(t) if t.len() != self.n_params => {
                Err(ShimError::Torch(format!("{} {what} for {} parameters", t.len(), self.n_params)))
            }
            Some(t) => Ok(handles(t)),
            None => Ok(vec![std::ptr::null_mut(); self.n_params]),
        }
    }
}

impl Drop for OverlappedBuckets {
    fn drop(&mut self) {
        // SAFETY: created by tg_buckets_new, freed once.
        unsafe { tg_buckets_free(self.handle) }
    }
}

/// A client connection of its own to the group's TCPStore, keys under `prefix`.
pub struct Store {
    handle: *mut c_void,
}

// SAFETY: one owner at a time uses the handle; c10d's TCPStore client serialises its requests.
unsafe impl Send for Store {}

impl Store {
    pub fn connect(host: &str, port: u16, timeout_ms: u64, prefix: &str) -> Result<Self, ShimError> {
        let host = CString::new(host).map_err(|_| ShimError::Torch("host contains NUL".into()))?;
        let prefix = CString::new(prefix).map_err(|_| ShimError::Torch("prefix contains NUL".into()))?;
        let mut err = [0u8; ERR_LEN];
        // SAFETY: both strings are NUL-terminated and outlive the call; `err` is ERR_LEN bytes.
        let handle = unsafe {
            tg_store_new(
                host.as_ptr(),
                port as c_int,
                timeout_ms as i64,
                prefix.as_ptr(),
                err.as_mut_ptr().cast(),
                ERR_LEN,
            )
        };
        if handle.is_null() {
            return Err(ShimError::Torch(message(&err)));
        }
        Ok(Self { handle })
    }

    /// Adds `delta` to the counter at `key` (0 when missing) and returns the new value; 0 reads.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, ShimError> {
        let key = CString::new(key).map_err(|_| ShimError::Torch("key contains NUL".into()))?;
        let (mut value, mut err) = (0i64, [0u8; ERR_LEN]);
        // SAFETY: live handle, NUL-terminated key, `value` and `err` outlive the call.
        check(
            unsafe {
                tg_store_add(self.handle, key.as_ptr(), delta, &mut value, err.as_mut_ptr().cast(), ERR_LEN)
            },
            &err,
        )?;
        Ok(value)
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: created by tg_store_new, freed once.
        unsafe { tg_store_free(self.handle) }
    }
}
