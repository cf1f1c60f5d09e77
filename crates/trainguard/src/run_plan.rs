//! A validated config plus the environment → the [`RunPlan`] a run executes, every value
//! resolved once into its typed form: the device, the world (ranks), the per-rank batch,
//! micro-batch and accumulation, the memory cap in bytes, the time limit, the step's settings
//! (precision, clipping, memory savers), the optimizer, the schedule and the checkpoint cadence.
//! Downstream code reads these, never re-parses the config's strings.
//! Pure: the environment comes in as [`Environment`], so every rule is unit-tested.
use crate::checkpoint::retention::Retention;
use crate::config::{parse_duration, Checkpointing, Config, Escalation, Problem};
use crate::data::batch;
use crate::optim::{LrSchedule, OptimizerSpec};
use crate::step::{LayoutSpec, Savers, StepSettings};
use std::path::Path;
use std::time::Duration;
use tch::Device;

/// What the plan needs to know about the machine and the launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Environment {
    pub cuda_devices: usize,
    pub rank: usize,
    pub local_rank: usize,
    pub world_size: usize,
    pub restart_count: u64,
    /// The run may continue from a checkpoint (`--resume auto` or a path): then `init_from` is
    /// read only if none is found, and checked there (`train::run`), not here.
    pub resuming: bool,
}

impl Environment {
    /// This process: the CUDA devices libtorch sees and the launch (`None`: one process).
    pub fn detect(launch: Option<&crate::distributed::DistEnv>) -> Self {
        let cuda_devices = tch::Cuda::device_count().max(0) as usize;
        match launch {
            Some(d) => Self {
                cuda_devices,
                rank: d.rank,
                local_rank: d.local_rank,
                world_size: d.world_size,
                restart_count: d.restart_count,
                resuming: false,
            },
            None => Self {
                cuda_devices,
                rank: 0,
                local_rank: 0,
                world_size: 1,
                restart_count: 0,
                resuming: false,
            },
        }
    }
}

#[derive(Debug, Clone)]
pub struct RunPlan {
    pub config: Config,
    pub device: Device,
    pub rank: usize,
    pub world_size: usize,
    /// torchrun's TORCHELASTIC_RESTART_COUNT (0 outside torchrun).
    pub restart_count: u64,
    /// This rank's share of each global batch: global indices `rank_start .. + rank_batch`
    /// (`batch::rank_slice`; shares differ by one when the world does not divide the batch).
    pub rank_start: usize,
    pub rank_batch: usize,
    /// Configured micro-batch (the OOM guard may lower it during the run).
    pub micro_batch: usize,
    pub accumulation: usize,
    pub tokens_per_step: usize,
    pub memory_limit: Option<u64>,
    /// `train.max_duration`.
    pub time_limit: Option<Duration>,
    /// Precision, clipping and memory savers of every step.
    pub step: StepSettings,
    pub optimizer: OptimizerSpec,
    /// Where the optimizer's state lives: `dist.shard` on this rank, `memory.offload_optimizer`.
    pub layout: LayoutSpec,
    pub schedule: LrSchedule,
    pub checkpoints: CheckpointPlan,
}

/// When checkpoints are written and which are kept (`checkpoint.*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CheckpointPlan {
    /// Every this many steps (0: only at the end and on stops).
    pub every_steps: u64,
    /// And whenever this much time has passed since the last one.
    pub every: Option<Duration>,
    pub retention: Retention,
    pub keep_best: bool,
}

impl CheckpointPlan {
    /// Whether a checkpoint is due after `completed` steps, `since_last` after the previous one,
    /// when the evaluation after this step found a `new_best` validation loss: with `keep_best`
    /// the best weights are written whatever the interval, or retention would have no
    /// checkpoint of them to keep.
    pub fn due(&self, completed: u64, since_last: Duration, new_best: bool) -> bool {
        (self.every_steps > 0 && completed.is_multiple_of(self.every_steps))
            || self.every.is_some_and(|d| since_last >= d)
            || (self.keep_best && new_best)
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{} problem(s) with the run plan:\n{}", .0.len(), Problem::list(.0))]
pub struct PlanError(pub Vec<Problem>);

impl RunPlan {
    /// Whether the model is evaluated once `completed` steps are done: every
    /// `train.eval_interval` completed steps and after the last, so an evaluation and an interval
    /// checkpoint of the same step hold the same weights.
    pub fn evaluates_after(&self, completed: u64) -> bool {
        let t = &self.config.train;
        t.eval_interval > 0 && (completed.is_multiple_of(t.eval_interval) || completed == t.max_steps)
    }

    /// Whether `eval.tasks` are scored after `completed` steps: every `eval.every_steps` and
    /// after the last, or when validation runs where that is unset.
    pub fn scores_tasks_after(&self, completed: u64) -> bool {
        let (e, max) = (&self.config.eval, self.config.train.max_steps);
        match e.every_steps {
            _ if e.tasks.is_empty() => false,
            Some(n) => n > 0 && (completed.is_multiple_of(n) || completed == max),
            None => self.evaluates_after(completed),
        }
    }

    pub fn build(config: Config, env: Environment) -> Result<Self, PlanError> {
        let mut problems = Vec::new();
        let device = resolve_device(&config.device, env.cuda_devices, env.local_rank).unwrap_or_else(|msg| {
            problems.push(Problem::new("device", msg));
            Device::Cpu
        });
        let t = &config.train;
        let accumulation = batch::accumulation(t.global_batch_size, t.micro_batch_size, env.world_size)
            .unwrap_or_else(|msg| {
                problems.push(Problem::new("train.global_batch_size", msg));
                0
            });
        let memory_limit =
            config.memory.limit.as_ref().map(|s| s.bytes()).transpose().unwrap_or_else(|msg| {
                problems.push(Problem::new("memory.limit", msg));
                None
            });
        if memory_limit.is_some() && !device.is_cuda() && config.precision != crate::config::Precision::Fp32 {
            // Seen: SIGSEGV in oneDNN's matmul primitive under an 8-16 MiB cap (no error, no
            // checkpoint, no stop record), "could not create a primitive" under others.
            let p = serde_yaml::to_string(&config.precision).unwrap_or_default();
            problems.push(Problem::new(
                "memory.limit",
                format!("a CPU cap with precision {}: the CPU's 16-bit matmuls are oneDNN's, which does not check its own allocations, so under the cap the process can die (SIGSEGV) instead of meeting an out-of-memory the guard catches; rehearse the guard on the CPU in fp32, or cap a CUDA device", p.trim()),
            ));
        }
        let time_limit = t.max_duration.as_deref().map(parse_duration).transpose().unwrap_or_else(|msg| {
            problems.push(Problem::new("train.max_duration", msg));
            None
        });
        let d = &config.data;
        let sources: Vec<(String, &str)> = match d.sources.is_empty() {
            true => vec![("data.source".into(), d.source.as_str())],
            false => d
                .sources
                .iter()
                .enumerate()
                .map(|(i, s)| (format!("data.sources[{i}].source"), s.source.as_str()))
                .collect(),
        };
        for (key, source) in sources {
            if let Some(path) = source.strip_prefix("tokens:") {
                if let Err(msg) = token_files_exist(path) {
                    problems.push(Problem::new(&key, msg));
                }
            }
            if let Some(path) = source.strip_prefix("text:").filter(|p| !Path::new(p).is_file()) {
                problems.push(Problem::new(&key, format!("file `{path}` does not exist or is not a file")));
            }
        }
        if let Some(dir) =
            config.init_from.as_deref().filter(|d| !env.resuming && !d.join("config.json").is_file())
        {
            problems.push(Problem::new(
                "init_from",
                format!("`{}` is not a Hugging Face model directory (no config.json)", dir.display()),
            ));
        }
        let m = &config.memory;
        let checkpointing = Checkpointing::parse(&m.activation_checkpointing).unwrap_or_else(|msg| {
            problems.push(Problem::new("memory.activation_checkpointing", msg));
            Checkpointing::None
        });
        if m.offload_activations
            && matches!(Checkpointing::parse(&m.activation_checkpointing), Ok(Checkpointing::None))
        {
            // Offload moves the inputs that checkpointing keeps; alone it would change nothing.
            problems.push(Problem::new(
                "memory.offload_activations",
                "true offloads the segment inputs that activation checkpointing keeps, and none are kept: set memory.activation_checkpointing (blocks, every_n:<k> or first_n:<m>) as well",
            ));
        }
        let f = &config.faults;
        for (key, rank) in [
            ("faults.crash_rank", Some(f.crash_rank).filter(|_| f.crash_at_step.is_some())),
            ("faults.fault_rank", f.fault_rank),
        ] {
            if let Some(r) = rank.filter(|&r| r >= env.world_size) {
                // No rank would run the fault: a test of it would pass without it.
                problems.push(Problem::new(
                    key,
                    format!(
                        "rank {r} does not exist in a world of {} (ranks 0..{})",
                        env.world_size, env.world_size
                    ),
                ));
            }
        }
        if env.world_size == 1 {
            // One rank owns every parameter: sharding would move nothing.
            let escalate = &config.oom.escalate;
            let sharding =
                [Escalation::ShardOptimizer, Escalation::ShardGradients, Escalation::ShardParameters];
            if let Some(e) = escalate.iter().find(|e| sharding.contains(e)) {
                problems.push(Problem::new(
                    "oom.escalate",
                    format!("`{}` shards over several ranks and this run has one (WORLD_SIZE 1): drop it, or launch with torchrun", e.name()),
                ));
            }
        }
        if !problems.is_empty() {
            return Err(PlanError(problems));
        }
        let step = StepSettings {
            precision: config.precision,
            device,
            grad_clip: t.grad_clip,
            savers: Savers::new(checkpointing, m.offload_activations, m.loss_chunk_tokens),
            escalate: config.oom.escalate.clone(),
        };
        let c = &config.checkpoint;
        let checkpoints = CheckpointPlan {
            every_steps: c.interval,
            every: c.interval_minutes.map(|m| Duration::from_secs_f64(m * 60.0)),
            retention: Retention { keep_last: c.keep_last, keep_every: c.keep_every },
            keep_best: c.keep_best,
        };
        let share = batch::rank_slice(t.global_batch_size, env.world_size, env.rank);
        Ok(Self {
            device,
            rank: env.rank,
            world_size: env.world_size,
            restart_count: env.restart_count,
            rank_start: share.start,
            rank_batch: share.len(),
            micro_batch: t.micro_batch_size,
            accumulation,
            tokens_per_step: t.global_batch_size * config.model.seq_len,
            memory_limit,
            time_limit,
            step,
            optimizer: OptimizerSpec::from_config(&config.optimizer, t, &config.kernels),
            layout: LayoutSpec {
                shard: config.dist.shard,
                rank: env.rank,
                world: env.world_size,
                chunk: LayoutSpec::chunk_for(config.dist.bucket_mb, env.world_size),
                offload: config.memory.offload_optimizer,
                overlap: config.dist.overlap,
            },
            schedule: LrSchedule::from_config(t),
            checkpoints,
            config,
        })
    }

    pub fn is_writer(&self) -> bool {
        self.rank == 0
    }
}

/// The files a `tokens:` source names (`data::shards::resolve`) all exist.
fn token_files_exist(path: &str) -> Result<(), String> {
    let s = crate::data::shards::resolve(path)?;
    match s.train.iter().chain(&s.val).find(|f| !f.is_file()) {
        Some(f) if f.exists() => Err(format!("`{}` is not a token file", f.display())),
        Some(f) => Err(format!("`{}` does not exist (tokens: takes a prepare directory, a directory or glob of shards, or a file)", f.display())),
        None => Ok(()),
    }
}

/// `auto` picks CUDA device `local_rank` (0 in a single process) when there is one, else the
/// CPU; `cuda` is `cuda:<local_rank>` among the devices this process sees. A process that sees
/// one device uses it whatever its rank (a launcher that gives each rank its own
/// `CUDA_VISIBLE_DEVICES`); more local ranks than visible devices is refused, since ranks
/// sharing a GPU fail in NCCL with an obscure error or silently slow each other down.
pub fn resolve_device(spec: &str, cuda_devices: usize, local_rank: usize) -> Result<Device, String> {
    let rank_device = || {
        match cuda_devices {
        1 => Ok(0),
        n if local_rank < n => Ok(local_rank),
        n => Err(format!(
            "`{spec}` on local rank {local_rank}, but this process sees {n} CUDA device(s): start one rank per GPU \
             (torchrun --nproc_per_node {n}) or give each rank its own CUDA_VISIBLE_DEVICES"
        )),
    }
    };
    match spec {
        "auto" if cuda_devices == 0 => Ok(Device::Cpu),
        "auto" => rank_device().map(Device::Cuda),
        "cpu" => Ok(Device::Cpu),
        _ => {
            let index = match spec.strip_prefix("cuda") {
                Some("") if cuda_devices > 0 => rank_device()?,
                Some("") => 0,
                Some(rest) => rest
                    .strip_prefix(':')
                    .and_then(|n| n.parse::<usize>().ok())
                    .ok_or_else(|| format!("must be auto, cpu, cuda or cuda:N, got `{spec}`"))?,
                None => return Err(format!("must be auto, cpu, cuda or cuda:N, got `{spec}`")),
            };
            if index >= cuda_devices {
                Err(format!(
                    "`{spec}` asked for, but this machine has {cuda_devices} CUDA device(s) visible to libtorch \
                     (see `trainguard env` and LIBTORCH.md)"
                ))
            } else {
                Ok(Device::Cuda(index))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPU_ONLY: Environment = Environment {
        cuda_devices: 0,
        rank: 0,
        local_rank: 0,
        world_size: 1,
        restart_count: 0,
        resuming: false,
    };

    #[test]
    fn derives_accumulation_and_tokens() {
        let plan = RunPlan::build(Config::default(), CPU_ONLY).unwrap();
        assert_eq!((plan.rank_batch, plan.micro_batch, plan.accumulation), (32, 8, 4));
        assert_eq!(plan.tokens_per_step, 32 * 64);
        let two = Environment { world_size: 2, ..CPU_ONLY };
        let plan = RunPlan::build(Config::default(), two).unwrap();
        assert_eq!((plan.rank_batch, plan.accumulation), (16, 2));
    }

    #[test]
    fn uneven_batches_split_with_a_remainder_and_ranks_share_by_index() {
        let mut c = Config::default();
        c.train.global_batch_size = 30;
        let plan = RunPlan::build(c.clone(), CPU_ONLY).unwrap();
        assert_eq!((plan.rank_start, plan.rank_batch, plan.accumulation), (0, 30, 4), "8 + 8 + 8 + 6");
        let shares: Vec<(usize, usize)> = (0..4)
            .map(|rank| RunPlan::build(c.clone(), Environment { world_size: 4, rank, ..CPU_ONLY }).unwrap())
            .map(|p| (p.rank_start, p.rank_batch))
            .collect();
        assert_eq!(shares, [(0, 7), (7, 8), (15, 7), (22, 8)]);
        c.train.micro_batch_size = 9;
        let err = RunPlan::build(c, Environment { world_size: 4, ..CPU_ONLY }).unwrap_err();
        assert_eq!(err.0[0].key, "train.global_batch_size");
        assert!(err.0[0].to_string().contains("at most 8"), "{err}");
    }

    #[test]
    fn a_fault_for_a_rank_outside_the_world_is_refused() {
        let mut c = Config::default();
        c.faults.crash_rank = 2; // without crash_at_step it names no fault
        RunPlan::build(c.clone(), Environment { world_size: 2, ..CPU_ONLY }).unwrap();
        c.faults.crash_at_step = Some(3);
        c.faults.fault_rank = Some(1);
        let err = RunPlan::build(c.clone(), Environment { world_size: 2, ..CPU_ONLY }).unwrap_err();
        assert_eq!(err.0.iter().map(|p| p.key.as_str()).collect::<Vec<_>>(), ["faults.crash_rank"]);
        assert!(err.to_string().contains("rank 2 does not exist in a world of 2"), "{err}");
        let err = RunPlan::build(c.clone(), CPU_ONLY).unwrap_err();
        assert_eq!(
            err.0.iter().map(|p| p.key.as_str()).collect::<Vec<_>>(),
            ["faults.crash_rank", "faults.fault_rank"]
        );
        RunPlan::build(c, Environment { world_size: 3, ..CPU_ONLY }).unwrap();
    }

    #[test]
    fn a_tokens_source_must_name_files_that_exist() {
        let mut c = Config::default();
        c.data.source = "tokens:/no/such/file.bin".into();
        let err = RunPlan::build(c, CPU_ONLY).unwrap_err();
        assert_eq!(err.0[0].key, "data.source");
        assert!(err.0[0].to_string().contains("/no/such/file.bin"), "{err}");
    }

    #[test]
    fn the_files_a_config_names_are_checked_here_not_by_the_config_rules() {
        let mut c = Config::default();
        c.data.source = "text:/no/such/file.txt".into();
        c.init_from = Some("/no/such/hf".into());
        assert!(crate::config::validate(&c).is_empty(), "a config written for another machine is valid");
        let err = RunPlan::build(c, CPU_ONLY).unwrap_err().to_string();
        assert!(err.contains("data.source: file `/no/such/file.txt` does not exist"), "{err}");
        assert!(err.contains("init_from: `/no/such/hf` is not a Hugging Face model directory"), "{err}");
        // A resume reads init_from only when it finds no checkpoint; the run checks it then.
        let c = Config { init_from: Some("/no/such/hf".into()), ..Config::default() };
        assert!(RunPlan::build(c, Environment { resuming: true, ..CPU_ONLY }).is_ok());
    }

    #[test]
    fn offload_without_checkpointing_is_refused_and_with_it_accepted() {
        let mut c = Config::default();
        c.memory.offload_activations = true;
        let err = RunPlan::build(c.clone(), CPU_ONLY).unwrap_err();
        assert_eq!(err.0.len(), 1, "{err}");
        assert_eq!(err.0[0].key, "memory.offload_activations");
        assert!(err.0[0].to_string().contains("memory.activation_checkpointing"), "{err}");
        c.memory.activation_checkpointing = "first_n:1".into();
        assert!(RunPlan::build(c.clone(), CPU_ONLY).unwrap().step.savers.offload);
        c.memory.activation_checkpointing = "every_n:x".into();
        let err = RunPlan::build(c, CPU_ONLY).unwrap_err();
        assert_eq!(
            err.0.iter().map(|p| p.key.as_str()).collect::<Vec<_>>(),
            ["memory.activation_checkpointing"],
            "one cause, not two: {err}"
        );
    }

    #[test]
    fn devices_resolve_against_what_exists() {
        assert_eq!(resolve_device("auto", 0, 0), Ok(Device::Cpu));
        assert_eq!(resolve_device("auto", 2, 0), Ok(Device::Cuda(0)));
        assert_eq!(resolve_device("auto", 2, 1), Ok(Device::Cuda(1)), "one GPU per local rank");
        assert_eq!(resolve_device("cuda", 2, 1), Ok(Device::Cuda(1)));
        assert_eq!(
            resolve_device("cuda", 1, 3),
            Ok(Device::Cuda(0)),
            "a rank given one device by CUDA_VISIBLE_DEVICES"
        );
        assert_eq!(resolve_device("cuda:1", 2, 0), Ok(Device::Cuda(1)));
        assert!(resolve_device("cuda", 0, 0).unwrap_err().contains("0 CUDA device"));
        assert!(resolve_device("cuda:2", 2, 0).is_err());
        for spec in ["auto", "cuda"] {
            let err = resolve_device(spec, 2, 3).unwrap_err();
            assert!(
                err.contains("local rank 3, but this process sees 2 CUDA device(s)")
                    && err.contains("--nproc_per_node 2"),
                "{err}"
            );
        }
    }

    #[test]
    fn strings_are_resolved_once_into_typed_values() {
        let mut c = Config::default();
        c.train.max_duration = Some("1h30m".into());
        c.memory.activation_checkpointing = "every_n:3".into();
        c.checkpoint.interval_minutes = Some(0.5);
        let plan = RunPlan::build(c, CPU_ONLY).unwrap();
        assert_eq!(plan.time_limit, Some(Duration::from_secs(5400)));
        assert_eq!(plan.step.savers.checkpoint_every, 3);
        assert_eq!(plan.checkpoints.every, Some(Duration::from_secs(30)));
        assert!(
            plan.checkpoints.due(7, Duration::from_secs(31), false)
                && !plan.checkpoints.due(7, Duration::from_secs(29), false)
        );
        let mut bad = Config::default();
        bad.train.max_duration = Some("soon".into());
        bad.memory.activation_checkpointing = "sometimes".into();
        let keys: Vec<String> =
            RunPlan::build(bad, CPU_ONLY).unwrap_err().0.into_iter().map(|p| p.key).collect();
        assert_eq!(
            keys,
            ["train.max_duration", "memory.activation_checkpointing"],
            "reported with their key paths, never a panic"
        );
    }

    #[test]
    fn evaluation_and_interval_checkpoints_fall_on_the_same_steps_and_a_new_best_is_written() {
        let mut c = Config::default();
        (c.train.max_steps, c.train.warmup_steps, c.train.eval_interval) = (23, 2, 5);
        (c.checkpoint.interval, c.checkpoint.keep_best) = (5, true);
        let plan = RunPlan::build(c, CPU_ONLY).unwrap();
        let evals: Vec<u64> = (1..=23).filter(|&n| plan.evaluates_after(n)).collect();
        assert_eq!(evals, [5, 10, 15, 20, 23], "every 5 completed steps and after the last");
        assert!(!(1..=23).any(|n| plan.scores_tasks_after(n)), "no eval.tasks: nothing scored");
        let mut tasks = plan.clone();
        tasks.config.eval.tasks = vec![crate::config::EvalTask { name: "t".into(), path: "t.jsonl".into() }];
        let scored: Vec<u64> = (1..=23).filter(|&n| tasks.scores_tasks_after(n)).collect();
        assert_eq!(scored, evals, "unset eval.every_steps: with validation");
        tasks.config.eval.every_steps = Some(7);
        let scored: Vec<u64> = (1..=23).filter(|&n| tasks.scores_tasks_after(n)).collect();
        assert_eq!(scored, [7, 14, 21, 23], "every 7 and after the last");
        let ckpts: Vec<u64> = (1..=23).filter(|&n| plan.checkpoints.due(n, Duration::ZERO, false)).collect();
        assert_eq!(ckpts, [5, 10, 15, 20], "the interval checkpoints hold evaluated weights");
        assert!(
            plan.checkpoints.due(23, Duration::ZERO, true),
            "a new best is written off the interval with keep_best"
        );
        let plain = CheckpointPlan { keep_best: false, ..plan.checkpoints };
        assert!(!plain.due(23, Duration::ZERO, true), "but not without it");
    }

    #[test]
    fn a_cpu_cap_is_refused_for_the_16_bit_precisions() {
        let mut c = Config::default();
        c.memory.limit = Some(crate::config::Size::Text("1GiB".into()));
        c.precision = crate::config::Precision::Bf16Mixed;
        let e = RunPlan::build(c.clone(), CPU_ONLY).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            e.contains("memory.limit: a CPU cap with precision bf16-mixed") && e.contains("SIGSEGV"),
            "{e}"
        );
        c.precision = crate::config::Precision::Fp32;
        assert!(RunPlan::build(c, CPU_ONLY).is_ok(), "fp32 under a CPU cap is the guard's CPU rehearsal");
    }

    #[test]
    fn memory_limit_is_parsed_to_bytes() {
        let mut c = Config::default();
        c.memory.limit = Some(crate::config::Size::Text("1GiB".into()));
        assert_eq!(RunPlan::build(c.clone(), CPU_ONLY).unwrap().memory_limit, Some(1 << 30));
        // A plain 0 is refused as `0B` is (it was taken, and the run then failed its setup, exit 3).
        c.memory.limit = Some(crate::config::Size::Bytes(0));
        assert!(crate::config::validate(&c)
            .iter()
            .any(|p| p.key == "memory.limit" && p.message.contains("at least one byte")));
    }
}
