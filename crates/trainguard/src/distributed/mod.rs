//! Everything that knows about ranks. The step asks it to "average these gradients" and "did
//! any rank run out of memory?", and works the same with one process (no `Dist`).
//! Uses PyTorch's own c10d engine through the shim: TCPStore + ProcessGroupGloo.
pub mod agree;
pub mod env;
mod error_file;
mod heartbeat;
pub mod ranks;
mod round;
pub mod shard;
mod store;
pub mod zero;
pub mod zero3;

pub use round::JobDeadline;

pub use env::{from_process_env, DistEnv, EnvError};
pub use error_file::write_error_file;
pub use heartbeat::StopNotice;

use crate::ffi::dist::{Backend, BucketSlot, OverlappedBuckets, OwnerReduces, ProcessGroup, ReduceOp};
use crate::ffi::ShimError;
use tch::{Device, Kind, TchError, Tensor};

#[derive(Debug, thiserror::Error)]
pub enum DistError {
    // The advice before libtorch's text, whose C++ trace lines the report cuts.
    #[error("cannot join the process group at {addr}{}: {message}", if .message.contains("timeout") { " (not every rank joined within dist.timeout_s: one that failed before joining, on its config for instance, names why in its own error; or fewer than WORLD_SIZE ranks were started)" } else { "" })]
    Init { addr: String, message: String },
    #[error("collective `{what}` {}{}: {message}", collective_outcome(.message), .silent.as_ref().map(|s| format!("; {s}")).unwrap_or_default())]
    Collective { what: &'static str, message: String, silent: Option<String> },
    #[error("dist.backend: {0}")]
    Backend(String),
}

/// How a failed collective ended, in words: the transports say a timeout several ways (Gloo's
/// blocking wait "Timed out waiting …", its pair closed by the timeout while a collective started
/// earlier was running, NCCL's watchdog "… timeout"), and the reader should not need to know them.
fn collective_outcome(message: &str) -> &'static str {
    let lower = message.to_lowercase();
    match lower.contains("timed out") || lower.contains("timeout") {
        true => "timed out after dist.timeout_s (a rank died or hung?)",
        false => "failed (a rank died, hung or timed out?)",
    }
}

/// What one rank brings to an agreement: its value (e.g. its loss), or how its work failed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LocalOutcome {
    Done(f64),
    /// `last_resort`: this rank would give up on it (at its floor, escalations spent).
    OutOfMemory {
        last_resort: bool,
    },
    /// Any other error: the run ends on every rank at once, the cause named.
    Failed,
}

/// What the ranks agreed on after a step's local work.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Agreement {
    pub any_oom: bool,
    /// A rank ran out of memory with nothing left to try: every rank gives up together.
    pub oom_gives_up: bool,
    /// How many ranks failed with an error that is not an out-of-memory.
    pub failed_ranks: usize,
    pub mean_value: f64,
}

/// This rank's membership in the data-parallel group.
pub struct Dist {
    pub rank: usize,
    pub world_size: usize,
    pub backend: Backend,
    group: ProcessGroup,
    buckets: Vec<Bucket>,
    /// The same buckets all-reduced from inside the last micro-step's backward (`dist.overlap`),
    /// or under `dist.shard: gradients` each gradient reduced into its owner's from there.
    overlapped: Option<OverlappedBuckets>,
    /// What `overlapped` starts, for the log: "gradient buckets all-reduced" or "gradients
    /// reduced into their owners", and how many there are.
    overlap_units: (&'static str, usize),
    /// Whether the first successful attempt's count of buckets started inside backward was logged.
    overlap_told: bool,
    /// Names the silent rank when a collective fails; None if it could not start.
    heartbeat: Option<heartbeat::Heartbeat>,
    /// Where small agreement tensors live: the CPU for Gloo, the rank's GPU for NCCL.
    small: Device,
    /// The job's deadline for `train.max_duration`, kept in torchrun's agent store (none
    /// without it, or without a time limit).
    pub job_deadline: Option<round::JobDeadline>,
    /// Fences passed after rank 0's work alone ([`Dist::after_writer`]).
    fences: u64,
}

/// A flat buffer made once, so averaging gradients allocates no tensor (Gloo's own scratch:
/// [`Dist::check_room_to_all_reduce`]).
struct Bucket {
    flat: Tensor,
    /// (parameter index, offset, numel)
    slots: Vec<(usize, i64, i64)>,
}

/// A failed collective, with which rank went silent when the heartbeats tell.
fn collective<'a>(
    what: &'static str,
    heartbeat: Option<&'a heartbeat::Heartbeat>,
) -> impl Fn(ShimError) -> DistError + 'a {
    move |e| DistError::Collective { what, message: e.to_string(), silent: heartbeat.map(|h| h.diagnosis()) }
}

/// A libtorch error around a collective (a copy, a move to the device): no rank went silent.
fn torch_error(what: &'static str) -> impl Fn(TchError) -> DistError + Copy {
    move |e| DistError::Collective { what, message: e.to_string(), silent: None }
}

impl Dist {
    /// Joins the group. The store lives at MASTER_ADDR:MASTER_PORT: hosted by torchrun's agent
    /// (TORCHELASTIC_USE_AGENT_STORE), where it outlives a restart and the ranks first agree on
    /// a namespace for this attempt's keys (crates/trainguard/src/distributed/round.rs), or by rank 0 for this process
    /// alone. `time_limit`: this process's `train.max_duration`, which the job's first attempt
    /// makes the job's deadline.
    pub fn init(
        env: &DistEnv,
        backend: Backend,
        device: Device,
        timeout_s: u64,
        time_limit: Option<std::time::Duration>,
    ) -> Result<Self, DistError> {
        let init = |message: String| DistError::Init {
            addr: format!("{}:{}", env.master_addr, env.master_port),
            message,
        };
        let host_store = !env.use_agent_store && env.rank == 0;
        let agreed = match env.use_agent_store {
            true => Some(Self::agree_on_attempt(env, timeout_s, time_limit).map_err(init)?),
            false => None,
        };
        let prefix = agreed.map_or("trainguard/".into(), |a| format!("trainguard/attempt-{}/", a.id));
        let group = ProcessGroup::new(
            backend,
            &env.master_addr,
            env.master_port,
            env.rank,
            env.world_size,
            host_store,
            timeout_s * 1000,
            &prefix,
        )
        .map_err(|e| init(e.to_string()))?;
        let small = if backend == Backend::Nccl { device } else { Device::Cpu };
        let heartbeat = heartbeat::Heartbeat::start(
            store::StoreAddress::new(&env.master_addr, env.master_port, &prefix),
            !env.use_agent_store,
            env.rank,
            env.world_size,
            timeout_s,
        )
        .map_err(|e| tracing::warn!("no heartbeat ({e}): a collective timeout will not name the silent rank"))
        .ok();
        let job_deadline = agreed.and_then(|a| a.deadline);
        Ok(Self {
            rank: env.rank,
            world_size: env.world_size,
            backend,
            group,
            buckets: Vec::new(),
            overlapped: None,
            overlap_units: ("gradient buckets all-reduced", 0),
            overlap_told: false,
            heartbeat,
            small,
            job_deadline,
            fences: 0,
        })
    }

    /// This attempt's id and the job's deadline, agreed with its peers through the agent's store.
    fn agree_on_attempt(
        env: &DistEnv,
        timeout_s: u64,
        time_limit: Option<std::time::Duration>,
    ) -> Result<round::Agreed, String> {
        let store = store::StoreAddress::new(&env.master_addr, env.master_port, "trainguard/rounds/")
            .connect(std::time::Duration::from_secs(timeout_s.max(1)))
            .map_err(|e| e.to_string())?;
        let give_up = std::time::Instant::now() + std::time::Duration::from_secs(timeout_s);
        // Only rank 0's proposal is read (`round::agree`).
        let own_deadline = time_limit
            .filter(|_| env.rank == 0)
            .map(|limit| crate::job::deadline::own_unix_ms(limit, crate::job::deadline::started_unix_s()));
        round::agree(&store, env.rank, env.world_size, round::nonce(), own_deadline, give_up)
    }

    /// How this rank tells its peers that a second signal ends it (None without a heartbeat).
    pub fn stop_notice(&self) -> Option<StopNotice> {
        self.heartbeat.as_ref().map(|h| h.stop_notice())
    }

    /// The peers that ended on a second signal, saying so first: asked after a collective failed.
    pub fn peers_stopped_by_signal(&self) -> Vec<usize> {
        self.heartbeat.as_ref().map(|h| h.stopped_by_signal()).unwrap_or_default()
    }

    /// `dist.backend` for this device: `auto` is NCCL on CUDA when this build has it, else Gloo.
    pub fn choose_backend(wanted: crate::config::DistBackend, device: Device) -> Result<Backend, DistError> {
        use crate::config::DistBackend as B;
        let nccl = crate::ffi::dist::nccl_built();
        match wanted {
            B::Gloo => Ok(Backend::Gloo),
            B::Auto => Ok(if device.is_cuda() && nccl { Backend::Nccl } else { Backend::Gloo }),
            B::Nccl if !device.is_cuda() => Err(DistError::Backend("nccl needs CUDA devices; this run is on the CPU (use gloo or auto)".into())),
            B::Nccl if !nccl => Err(DistError::Backend("this trainguard was built without NCCL (CUDA/NCCL headers were missing at build time); use gloo".into())),
            B::Nccl => Ok(Backend::Nccl),
        }
    }

    /// Lays gradients out in flat buckets of about `bucket_bytes`, in parameter order. With
    /// `hooked` (one flag a parameter: a block's, whose gradient backward makes once), the
    /// buckets are all-reduced from inside backward as they fill (`dist.overlap`): a bucket
    /// holds hooked parameters only or none, and the hooked ones start first, the last first
    /// (backward makes the last block's gradients first), the others at the end.
    pub fn plan_buckets(
        &mut self,
        params: &[Tensor],
        bucket_bytes: usize,
        device: Device,
        hooked: Option<&[bool]>,
    ) -> Result<(), TchError> {
        let is_hooked = |i: usize| hooked.is_some_and(|h| h[i]);
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut slots = Vec::new();
        let mut len = 0i64;
        let flush = |slots: &mut Vec<(usize, i64, i64)>, len: &mut i64, out: &mut Vec<Bucket>| {
            if !slots.is_empty() {
                out.push(Bucket {
                    flat: Tensor::f_zeros([*len], (Kind::Float, device))?,
                    slots: std::mem::take(slots),
                });
                *len = 0;
            }
            Ok::<(), TchError>(())
        };
        for (i, p) in params.iter().enumerate() {
            if i > 0 && is_hooked(i) != is_hooked(i - 1) {
                flush(&mut slots, &mut len, &mut buckets)?;
            }
            let n = p.numel() as i64;
            slots.push((i, len, n));
            len += n;
            if (len as usize) * 4 >= bucket_bytes {
                flush(&mut slots, &mut len, &mut buckets)?;
            }
        }
        flush(&mut slots, &mut len, &mut buckets)?;
        self.overlapped = None;
        if hooked.is_some() {
            let hooked_bucket = |b: &Bucket| b.slots.iter().all(|&(i, _, _)| is_hooked(i));
            let (first, last): (Vec<usize>, Vec<usize>) =
                (0..buckets.len()).rev().partition(|&k| hooked_bucket(&buckets[k]));
            let order: Vec<usize> = first.into_iter().chain(last.into_iter().rev()).collect();
            let mut where_ = vec![BucketSlot { bucket: 0, offset: 0, hooked: false }; params.len()];
            for (k, b) in buckets.iter().enumerate() {
                for &(i, offset, _) in &b.slots {
                    where_[i] = BucketSlot { bucket: k, offset, hooked: is_hooked(i) };
                }
            }
            let flats: Vec<Tensor> = buckets.iter().map(|b| b.flat.shallow_clone()).collect();
            let made = self.group.overlapped_buckets(params, &where_, &flats, &order);
            self.overlapped = Some(made.map_err(|e| TchError::Torch(e.to_string()))?);
            self.overlap_units = ("gradient buckets all-reduced", buckets.len());
        }
        self.buckets = buckets;
        Ok(())
    }

    /// Frees the all-reduce buckets (sharded gradients are reduce-scattered instead).
    pub fn release_buckets(&mut self) {
        self.overlapped = None;
        self.buckets.clear();
    }

    /// Whether collectives start from inside backward (`dist.overlap`, where it was allowed).
    pub fn overlaps(&self) -> bool {
        self.overlapped.is_some()
    }

    /// `dist.shard: gradients` under `dist.overlap`: the last micro-step's backward sums each
    /// block parameter's gradient (`hooked`) into its owner's under `shard`, in place, as soon as
    /// backward made it; the others follow after backward ([`Dist::reduce_all`]). Pieces of
    /// `dist.bucket_mb` (the sharded collectives' per-rank chunk over every rank); the one
    /// buffer made is a piece of scratch, what a rank whose backward failed sends so that its
    /// peers' reduces complete. Replaces the all-reduce buckets.
    /// Only fp32 gradients are summed in place (bf16's would round at every rank's addition):
    /// false, and nothing set up, for others (`bf16-pure`), which are reduce-scattered after
    /// backward through fp32 pieces.
    pub fn reduce_into_owners_in_backward(
        &mut self,
        params: &[Tensor],
        hooked: &[bool],
        shard: &shard::Sharding,
        device: Device,
    ) -> Result<bool, TchError> {
        self.release_buckets();
        if params.iter().any(|p| p.kind() != Kind::Float) {
            return Ok(false);
        }
        let (own, piece) = (&shard.ownership, (shard.chunk * self.world_size as i64).max(1));
        // The blocks' parameters, the last first (backward makes them first), then the others.
        let (first, rest): (Vec<usize>, Vec<usize>) = (0..params.len()).rev().partition(|&i| hooked[i]);
        let reduce = OwnerReduces {
            owners: (0..params.len()).map(|i| own.owner(i)).collect(),
            numels: own.numels().to_vec(),
            order: first.into_iter().chain(rest.into_iter().rev()).collect(),
            chunk: piece,
            rank: self.rank,
            scratch: Tensor::f_zeros([piece], (Kind::Float, device))?,
        };
        let made = self.group.overlapped_reduces(params, hooked, &reduce);
        self.overlapped = Some(made.map_err(|e| TchError::Torch(e.to_string()))?);
        self.overlap_units = ("gradients reduced into their owners", params.len());
        Ok(true)
    }

    /// Under `dist.overlap`, after the armed backward: the parameters whose gradients went out
    /// from inside it (their memory is being reduced: the caller must not add into it). None
    /// when nothing was armed.
    pub fn overlap_arrived(&self) -> Option<Vec<bool>> {
        self.overlapped.as_ref().map(|o| o.arrived())
    }

    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    /// Under `dist.overlap`, before the step's last micro-step: its backward all-reduces each
    /// block's bucket as it fills, adding `sums` (the earlier micro-steps' gradients, one per
    /// parameter; none on the first) on the way. False (nothing armed) without overlapped
    /// buckets.
    pub fn arm_overlap(&self, sums: Option<&[Tensor]>) -> Result<bool, TchError> {
        let Some(o) = &self.overlapped else { return Ok(false) };
        o.arm(sums).map_err(|e| TchError::Torch(e.to_string()))?;
        Ok(true)
    }

    /// Gloo passes a bucket round the ring through host scratch it allocates for each all-reduce
    /// (two segments, at most 1/world of the bucket in all: gloo/allreduce.cc), and a rank
    /// whose scratch fails cannot leave the ring: its peers wait on it until the timeout. So
    /// before the step's agreement, where such a rank replays with every other, this checks
    /// that the largest bucket's size, and 1 MiB for the transport's own bookkeeping, can be
    /// allocated on the host; freed at once, it is there again for the all-reduces, since only
    /// the agreement runs in between. Nothing to check under NCCL, whose buffers are its own,
    /// nor under `dist.overlap`, whose all-reduces ran before the agreement.
    pub fn check_room_to_all_reduce(&self) -> Result<(), TchError> {
        if self.overlapped.is_some() {
            return Ok(());
        }
        let host = |b: &&Bucket| self.backend == Backend::Gloo && b.flat.device() == Device::Cpu;
        let bytes = |b: &Bucket| b.flat.numel() as i64 * b.flat.kind().elt_size_in_bytes() as i64;
        match self.buckets.iter().filter(host).map(bytes).max() {
            Some(largest) => Tensor::f_empty([largest + (1 << 20)], (Kind::Uint8, Device::Cpu)).map(drop),
            None => Ok(()),
        }
    }

    /// Replaces each gradient by its mean over ranks: one all-reduce per bucket, started and
    /// finished here, or (under `dist.overlap`) from inside backward by [`Dist::reduce_all`].
    pub fn average_gradients(&mut self, grads: &mut [Tensor]) -> Result<(), DistError> {
        let torch = torch_error("gradient all-reduce");
        let _no_grad = tch::no_grad_guard();
        let scale = 1.0 / self.world_size as f64;
        let heartbeat = self.heartbeat.as_ref();
        if self.buckets.is_empty() && !grads.is_empty() {
            return Err(DistError::Collective {
                what: "gradient all-reduce",
                message: "no buckets laid out (Dist::plan_buckets)".into(),
                silent: None,
            });
        }
        let reduced = self.overlapped.is_some();
        for b in &mut self.buckets {
            if !reduced {
                for &(i, off, n) in &b.slots {
                    b.flat
                        .f_narrow(0, off, n)
                        .map_err(torch)?
                        .f_copy_(&grads[i].f_reshape([n]).map_err(torch)?)
                        .map_err(torch)?;
                }
                self.group
                    .all_reduce(&mut b.flat, ReduceOp::Sum)
                    .map_err(collective("gradient all-reduce", heartbeat))?;
            }
            for &(i, off, n) in &b.slots {
                let avg = b
                    .flat
                    .f_narrow(0, off, n)
                    .map_err(torch)?
                    .f_view(grads[i].size().as_slice())
                    .map_err(torch)?;
                grads[i].f_copy_(&avg).map_err(torch)?;
                let _ = grads[i].f_mul_scalar_(scale).map_err(torch)?;
            }
        }
        Ok(())
    }

    /// Under `dist.overlap`: every bucket not started from inside backward is, from this rank's
    /// gradients (`grads`; none when its attempt failed: its buckets are reduced as they are,
    /// so that its peers' collectives complete), and all are waited for. Every rank calls it
    /// once an attempt, before the agreement, whatever its backward did. How many buckets had
    /// started inside backward; none without overlap.
    pub fn reduce_all(&mut self, grads: Option<&[Tensor]>) -> Result<Option<usize>, DistError> {
        let Some(o) = &self.overlapped else { return Ok(None) };
        let early = o.finish(grads).map_err(collective("gradient all-reduce", self.heartbeat.as_ref()))?;
        if grads.is_some() && !std::mem::replace(&mut self.overlap_told, true) {
            // Fewer than the blocks' buckets: their gradients did not all come through the hooks
            // (CUDA graphs, kernels.accumulate_in_gemm's sums), and those wait for the end.
            let (what, all) = self.overlap_units;
            tracing::info!("rank {}: dist.overlap: {early} of {all} {what} during backward", self.rank);
        }
        Ok(Some(early))
    }

    /// All ranks learn whether any ran out of memory or failed otherwise, and the mean of the
    /// values (e.g. the loss). A failing rank joins too, so its peers stop with it instead of
    /// failing in the next collective without the cause (after `dist.timeout_s` on NCCL).
    pub fn agree(&self, local: LocalOutcome) -> Result<Agreement, DistError> {
        let slots = match local {
            LocalOutcome::Done(value) => [0.0f64, 0.0, value, 0.0],
            LocalOutcome::OutOfMemory { last_resort } => [1.0, 0.0, 0.0, f64::from(u8::from(last_resort))],
            LocalOutcome::Failed => [0.0, 1.0, 0.0, 0.0],
        };
        let v = self.all_reduce_values("OOM agreement", &slots, ReduceOp::Sum)?;
        Ok(Agreement {
            any_oom: v[0] > 0.0,
            oom_gives_up: v[3] > 0.0,
            failed_ranks: v[1].round() as usize,
            mean_value: v[2] / self.world_size as f64,
        })
    }

    /// The largest of every rank's `value`, on every rank.
    pub fn max(&self, value: f64) -> Result<f64, DistError> {
        Ok(self.max_each(&[value])?[0])
    }

    /// The largest of every rank's value in each slot, on every rank (the stop agreement: each
    /// rank's reason to stop as a code, so all stop together and name the same reason).
    pub fn max_each(&self, values: &[f64]) -> Result<Vec<f64>, DistError> {
        self.all_reduce_values("stop agreement", values, ReduceOp::Max)
    }

    /// The sum of every rank's value in each slot, on every rank (downstream evaluation's
    /// counts: each rank scores its share of the examples).
    pub fn sum_each(&self, values: &[f64]) -> Result<Vec<f64>, DistError> {
        self.all_reduce_values("downstream evaluation", values, ReduceOp::Sum)
    }

    /// Every rank waits here for rank 0's work alone (a checkpoint, the final weights) for as
    /// long as rank 0 is alive, not `dist.timeout_s`, or `writer_wait` at most
    /// ([`heartbeat::Heartbeat::fence`]). Without a heartbeat the next collective waits, as
    /// before.
    pub fn after_writer(&mut self, writer_wait: Option<std::time::Duration>) -> Result<(), DistError> {
        let Some(heartbeat) = self.heartbeat.as_ref() else { return Ok(()) };
        self.fences += 1;
        heartbeat.fence(self.fences, writer_wait).map_err(|message| DistError::Collective {
            what: "wait for rank 0's writing",
            message,
            silent: None,
        })
    }

    /// The smallest and the largest of every rank's `value`, on every rank.
    pub fn spread(&self, value: f64) -> Result<(f64, f64), DistError> {
        Ok((-self.max(-value)?, self.max(value)?))
    }

    /// Rank 0's `bytes` on every rank (each rank passes its own; only rank 0's are sent).
    pub fn rank0_bytes(&self, mine: &[u8]) -> Result<Vec<u8>, DistError> {
        const WHAT: &str = "start comparison";
        let torch = torch_error(WHAT);
        let on_small = |t: Tensor| t.f_to_device(self.small).map_err(torch);
        let mut len = on_small(Tensor::from_slice(&[mine.len() as i64]))?;
        self.group.broadcast(&mut len, 0).map_err(collective(WHAT, self.heartbeat.as_ref()))?;
        let len = len.f_int64_value(&[0]).map_err(torch)?;
        let mut buf = if self.rank == 0 {
            on_small(Tensor::from_slice(mine))?
        } else {
            on_small(Tensor::zeros([len], (Kind::Uint8, Device::Cpu)))?
        };
        self.group.broadcast(&mut buf, 0).map_err(collective(WHAT, self.heartbeat.as_ref()))?;
        Vec::<u8>::try_from(&buf.f_to_device(Device::Cpu).map_err(torch)?).map_err(torch)
    }

    /// Every rank's `mine` (the same length on each), indexed by rank, on every rank.
    pub fn each_rank(&self, mine: &[f64]) -> Result<Vec<Vec<f64>>, DistError> {
        let k = mine.len();
        let mut slots = vec![0f64; self.world_size * k];
        slots[self.rank * k..(self.rank + 1) * k].copy_from_slice(mine);
        let v = self.all_reduce_values("shard exchange", &slots, ReduceOp::Sum)?;
        Ok(v.chunks(k.max(1)).map(<[f64]>::to_vec).collect())
    }

    /// The ranks that pass `flagged` true, in order, on every rank.
    pub fn flagged_ranks(&self, flagged: bool) -> Result<Vec<usize>, DistError> {
        let mut slots = vec![0f64; self.world_size];
        slots[self.rank] = if flagged { 1.0 } else { 0.0 };
        let v = self.all_reduce_values("start comparison", &slots, ReduceOp::Sum)?;
        Ok(v.iter().enumerate().filter(|(_, f)| **f > 0.0).map(|(r, _)| r).collect())
    }

    /// Every rank's `values` reduced element-wise by `op`, on every rank: the small round trip
    /// (host → agreement device → host) behind each agreement.
    fn all_reduce_values(
        &self,
        what: &'static str,
        values: &[f64],
        op: ReduceOp,
    ) -> Result<Vec<f64>, DistError> {
        let torch = torch_error(what);
        let mut t = Tensor::f_from_slice(values).and_then(|t| t.f_to_device(self.small)).map_err(torch)?;
        self.group.all_reduce(&mut t, op).map_err(collective(what, self.heartbeat.as_ref()))?;
        Vec::try_from(&t.f_to_device(Device::Cpu).map_err(torch)?).map_err(torch)
    }

    /// Rank 0's parameter values on every rank.
    pub fn broadcast_params(&self, params: &[Tensor]) -> Result<(), DistError> {
        let _no_grad = tch::no_grad_guard();
        for p in params {
            let mut p = p.shallow_clone();
            self.group
                .broadcast(&mut p, 0)
                .map_err(collective("weight broadcast", self.heartbeat.as_ref()))?;
        }
        Ok(())
    }

    /// Largest difference of a per-parameter checksum across ranks: 0 when all ranks hold the
    /// same weights (DDP's parameter verification, cheaply).
    pub fn weight_spread(&self, params: &[Tensor]) -> Result<f64, DistError> {
        // Summed a piece at a time: a whole fp64 copy of the largest tensor (and of its absolute
        // value) made this check the run's peak where the step holds little (`dist.shard:
        // parameters`), 8 GB for a Llama-3-8B embedding.
        let l1 = |p: &Tensor| -> Result<f64, TchError> {
            let _no_grad = tch::no_grad_guard();
            let mut total = Tensor::f_zeros([], (Kind::Double, p.device()))?;
            for piece in p.f_reshape([-1])?.f_split(1 << 20, 0)? {
                total = total.f_add(&piece.f_abs()?.f_sum(Kind::Double)?)?;
            }
            total.f_double_value(&[])
        };
        let sums =
            params.iter().map(l1).collect::<Result<Vec<f64>, _>>().map_err(torch_error("weight check"))?;
        let negated: Vec<f64> = sums.iter().map(|s| -s).collect();
        let hi = self.all_reduce_values("weight check", &sums, ReduceOp::Max)?;
        let lo = self.all_reduce_values("weight check", &negated, ReduceOp::Max)?;
        // NaN (a NaN weight, or infinite sums) stays NaN: "ranks differ", never "identical".
        Ok(hi.iter().zip(&lo).map(|(h, l)| (h + l).abs()).fold(0.0, |a, d| {
            if a.is_nan() || d.is_nan() {
                f64::NAN
            } else {
                a.max(d)
            }
        }))
    }

    pub fn barrier(&self) -> Result<(), DistError> {
        self.group.barrier().map_err(collective("barrier", self.heartbeat.as_ref()))
    }
}

#[cfg(test)]
pub(crate) mod overlap_tests {
    use super::*;

    /// A group of one Gloo rank on a free local port.
    pub(crate) fn alone() -> Dist {
        rank_of(0, 1, free_port())
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    /// Rank `rank` of a Gloo group of `world` at `port` (rank 0 hosts the store); every rank
    /// must join at once, each on a thread of its own.
    fn rank_of(rank: usize, world: usize, port: u16) -> Dist {
        let env = DistEnv {
            rank,
            local_rank: rank,
            world_size: world,
            local_world_size: world,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            use_agent_store: false,
            restart_count: 0,
            error_file: None,
        };
        Dist::init(&env, Backend::Gloo, Device::Cpu, 30, None).unwrap()
    }

    /// A "block" parameter `a` (hooked) and an "embedding" one `b`, the loss a·a + 3b summed
    /// (scaled by `k`): d/da = 2ka, d/db = 3k.
    struct TwoParams {
        a: Tensor,
        b: Tensor,
    }

    impl TwoParams {
        fn new() -> Self {
            Self {
                a: Tensor::from_slice(&[1.0f32, 2.0, 3.0]).set_requires_grad(true),
                b: Tensor::from_slice(&[4.0f32, 5.0]).set_requires_grad(true),
            }
        }

        fn params(&self) -> [Tensor; 2] {
            [self.a.shallow_clone(), self.b.shallow_clone()]
        }

        fn backward(&self, k: f64) -> Vec<Tensor> {
            let loss = ((&self.a * &self.a).sum(Kind::Float) + (&self.b * 3.0).sum(Kind::Float)) * k;
            Tensor::f_run_backward(&[&loss], &self.params(), false, false).unwrap()
        }
    }

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(t).unwrap()
    }

    /// `dist.shard: gradients` under `dist.overlap`, one rank: the armed backward adds the
    /// block parameter's gradient into the caller's sum in place and sends it (in pieces of 2:
    /// 3 elements are two reduces); the caller must not add it again; finish sends the rest.
    #[test]
    fn an_armed_backward_reduces_the_hooked_gradients_into_their_owners_in_place() {
        let mut d = alone();
        let two = TwoParams::new();
        let shard = shard::Sharding::new(crate::config::ShardLevel::Gradients, &[3, 2], 0, 1, 2).unwrap();
        assert!(d
            .reduce_into_owners_in_backward(&two.params(), &[true, false], &shard, Device::Cpu)
            .unwrap());
        let sums = [Tensor::from_slice(&[10.0f32, 10.0, 10.0]), Tensor::from_slice(&[1.0f32, 1.0])];
        d.arm_overlap(Some(&sums)).unwrap();
        let micro = two.backward(1.0);
        assert_eq!(values(&sums[0]), [12.0, 14.0, 16.0], "sum + 2a, in the caller's memory, inside backward");
        assert_eq!(values(&sums[1]), [1.0, 1.0], "not hooked: the caller adds it");
        assert_eq!(d.overlap_arrived(), Some(vec![true, false]));
        let _ = sums[1].shallow_clone().f_add_(&micro[1]).unwrap();
        assert_eq!(d.reduce_all(Some(&sums)).unwrap(), Some(1), "the hooked one started inside backward");
        let owned = d.owned_means(&sums, &shard).unwrap();
        assert_eq!((values(&owned[0]), values(&owned[1])), (vec![12.0, 14.0, 16.0], vec![4.0, 4.0]));

        // One micro-step (no sums): the gradient itself is sent and returned.
        d.arm_overlap(None).unwrap();
        let grads = two.backward(1.0);
        d.reduce_all(Some(&grads)).unwrap();
        assert_eq!((values(&grads[0]), values(&grads[1])), (vec![2.0, 4.0, 6.0], vec![3.0, 3.0]));

        // A sum that is not the caller's fp32 memory cannot be reduced in place: refused.
        let halves = [sums[0].to_kind(Kind::BFloat16), sums[1].shallow_clone()];
        let err = d.arm_overlap(Some(&halves)).unwrap_err().to_string();
        assert!(err.contains("not contiguous fp32"), "{err}");
        d.reduce_all(None).unwrap();
        // bf16 parameters are not set up at all (reduce-scattered through fp32 pieces instead).
        let bf16 = [two.a.to_kind(Kind::BFloat16), two.b.to_kind(Kind::BFloat16)];
        assert!(!d.reduce_into_owners_in_backward(&bf16, &[true, false], &shard, Device::Cpu).unwrap());
        assert!(!d.overlaps());
    }

    /// Two ranks: rank 1's attempt fails before its backward (as one that ran out of memory
    /// there), and it still sends every piece, from its scratch, so rank 0's reduces complete
    /// instead of waiting for it; the next attempt, whole on both, sums each gradient into its
    /// owner's (`a` is rank 0's, `b` rank 1's).
    #[test]
    fn a_rank_whose_backward_failed_still_sends_every_reduce_and_the_next_attempt_sums() {
        let port = free_port();
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                std::thread::spawn(move || {
                    let mut d = rank_of(rank, 2, port);
                    let two = TwoParams::new();
                    // Pieces of 2 elements: a chunk of 1 on each of the 2 ranks.
                    let shard =
                        shard::Sharding::new(crate::config::ShardLevel::Gradients, &[3, 2], rank, 2, 1)
                            .unwrap();
                    d.reduce_into_owners_in_backward(&two.params(), &[true, false], &shard, Device::Cpu)
                        .unwrap();
                    d.arm_overlap(None).unwrap();
                    match rank {
                        0 => d.reduce_all(Some(&two.backward(1.0))).unwrap(),
                        _ => d.reduce_all(None).unwrap(),
                    };
                    d.arm_overlap(None).unwrap();
                    let grads = two.backward(1.0 + rank as f64);
                    d.reduce_all(Some(&grads)).unwrap();
                    d.owned_means(&grads, &shard).unwrap().iter().map(values).collect::<Vec<_>>()
                })
            })
            .collect();
        let owned: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
        // Mean over the ranks of 2ka (k = 1, 2) and of 3k.
        assert_eq!(owned, [vec![vec![3.0, 6.0, 9.0]], vec![vec![4.5, 4.5]]]);
    }

    fn flat(d: &Dist, k: usize) -> Vec<f32> {
        Vec::<f32>::try_from(&d.buckets[k].flat).unwrap()
    }

    #[test]
    fn an_armed_backward_fills_and_starts_the_hooked_buckets_and_finish_does_the_rest() {
        let mut d = alone();
        // A "block" parameter (hooked) and an "embedding" one, each a bucket of its own.
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).set_requires_grad(true);
        let b = Tensor::from_slice(&[4.0f32, 5.0]).set_requires_grad(true);
        let params = [a.shallow_clone(), b.shallow_clone()];
        d.plan_buckets(&params, 4, Device::Cpu, Some(&[true, false])).unwrap();
        assert_eq!(d.bucket_count(), 2);
        let backward = || {
            let loss = (&a * &a).sum(Kind::Float) + (&b * 3.0).sum(Kind::Float);
            Tensor::f_run_backward(&[&loss], &params, false, false).unwrap()
        };
        // The earlier micro-steps' sums, added on the way by the hook.
        let sums = [Tensor::from_slice(&[10.0f32, 10.0, 10.0]), Tensor::from_slice(&[1.0f32, 1.0])];
        d.arm_overlap(Some(&sums)).unwrap();
        let mut grads = backward();
        assert_eq!(flat(&d, 0), [12.0, 14.0, 16.0], "sum + 2a, written inside backward");
        assert_eq!(flat(&d, 1), [0.0, 0.0], "not hooked: left for finish");
        // The caller's own accumulation, as forward_backward does it.
        for (g, s) in grads.iter_mut().zip(&sums) {
            *g = &*g + s;
        }
        assert_eq!(d.reduce_all(Some(&grads)).unwrap(), Some(1), "the hooked bucket started inside backward");
        assert_eq!(flat(&d, 1), [4.0, 4.0], "copied from the gradients by finish");
        d.average_gradients(&mut grads).unwrap();
        assert_eq!(Vec::<f32>::try_from(&grads[0]).unwrap(), [12.0, 14.0, 16.0]);

        // Unarmed (an earlier micro-step): the hooks write nothing; finish takes the gradients.
        let _ = d.buckets[0].flat.zero_();
        let grads = backward();
        assert_eq!(flat(&d, 0), [0.0, 0.0, 0.0]);
        d.reduce_all(Some(&grads)).unwrap();
        assert_eq!(flat(&d, 0), [2.0, 4.0, 6.0]);

        // A gradient that arrives twice in one armed backward is an error, not a wrong sum.
        d.arm_overlap(None).unwrap();
        backward();
        let grads = backward();
        let err = d.reduce_all(Some(&grads)).unwrap_err().to_string();
        assert!(err.contains("arrived twice"), "{err}");
        // And the next attempt starts clean.
        d.arm_overlap(None).unwrap();
        let grads = backward();
        d.reduce_all(Some(&grads)).unwrap();
        assert_eq!(flat(&d, 0), [2.0, 4.0, 6.0]);
    }
}

#[cfg(test)]
mod tests {
    use super::collective_outcome;

    /// Gloo's texts as its collectives end (captured from runs of libtorch 2.11: hung_rank's, and
    /// a rank killed with -9): a blocking wait past dist.timeout_s, a pair the timeout closed
    /// under a collective started inside backward (dist.overlap), and a peer that died.
    #[test]
    fn every_transport_timeout_is_called_one_and_a_dead_peer_is_not() {
        let waited = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation to complete";
        let closed = "libtorch: Application timeout caused pair closure";
        let died = "libtorch: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:538] Read error [127.0.0.1]:59068: Connection reset by peer";
        for timeout in [waited, closed] {
            assert!(collective_outcome(timeout).starts_with("timed out after dist.timeout_s"), "{timeout}");
        }
        assert!(collective_outcome(died).starts_with("failed"), "{died}");
    }
}
