//! Per-key rules for a [`Config`]: every broken rule becomes a [`Problem`] naming its key path,
//! and all of them are reported together. Rules that need the environment (world size, device
//! presence, the files data.source and init_from name) live in the run plan (`run_plan.rs`):
//! `plan` and `config show` take a config written for another machine.
use super::limits::*;
use super::Config;
use std::fmt;

#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub key: String,
    pub message: String,
}

impl Problem {
    pub fn new(key: &str, message: impl Into<String>) -> Self {
        Self { key: key.to_string(), message: message.into() }
    }

    pub(crate) fn list(problems: &[Problem]) -> String {
        problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n")
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

/// `divergence.*` (checked whether or not it is enabled: a value set is a value meant) and the
/// fault that tests it.
fn check_divergence(c: &Config, check: &mut impl FnMut(bool, &str, String)) {
    let d = &c.divergence;
    let positive = |v: f64| v.is_finite() && v > 0.0;
    check(d.window >= 3, "divergence.window", format!("must be at least 3 steps, got {}", d.window));
    check(
        // Against a window that is itself refused, the window's problem is the one to name.
        d.min_history >= 3 && (d.window < 3 || d.min_history <= d.window),
        "divergence.min_history",
        format!("must be in 3..=divergence.window ({}), got {}", d.window, d.min_history),
    );
    check(
        positive(d.threshold),
        "divergence.threshold",
        format!("must be a number above 0, got {}", d.threshold),
    );
    check(
        d.min_rise.is_finite() && d.min_rise >= 0.0,
        "divergence.min_rise",
        format!("must be a number at least 0, got {}", d.min_rise),
    );
    if let Some(g) = d.grad_norm_threshold {
        check(
            positive(g),
            "divergence.grad_norm_threshold",
            format!("must be a number above 0 or null, got {g}"),
        );
    }
    check(
        d.rollback_window >= 1,
        "divergence.rollback_window",
        format!("must be at least 1 step, got {}", d.rollback_window),
    );
    check(
        positive(d.lr_factor) && d.lr_factor <= 1.0,
        "divergence.lr_factor",
        format!("must be in (0, 1] (1 keeps the learning rate), got {}", d.lr_factor),
    );
    let checkpoints = c.checkpoint.interval > 0 || c.checkpoint.interval_minutes.is_some();
    check(
        !d.enabled || checkpoints,
        "divergence.enabled",
        "a rollback returns to the last checkpoint: set checkpoint.interval (or checkpoint.interval_minutes) too".into(),
    );
    if let Some(f) = c.faults.lr_spike {
        check(
            f.data_step >= 1,
            "faults.lr_spike.data_step",
            format!("steps count from 1, got {}", f.data_step),
        );
        check(
            positive(f.factor),
            "faults.lr_spike.factor",
            format!("must be a number above 0, got {}", f.factor),
        );
    }
}

/// Checks every rule; an empty list means the config is valid.
pub fn validate(c: &Config) -> Vec<Problem> {
    let mut p = Vec::new();
    let mut check = |ok: bool, key: &str, msg: String| {
        if !ok {
            p.push(Problem::new(key, msg));
        }
    };
    let m = &c.model;
    let within = |v: usize, max: usize| format!("must be in 1..={max}, got {v}");
    check((1..=MAX_LAYERS).contains(&m.n_layer), "model.n_layer", within(m.n_layer, MAX_LAYERS));
    check(m.n_head >= 1, "model.n_head", format!("must be at least 1, got {}", m.n_head));
    check((1..=MAX_WIDTH).contains(&m.n_embd), "model.n_embd", within(m.n_embd, MAX_WIDTH));
    check(
        m.n_head == 0 || m.n_embd.is_multiple_of(m.n_head),
        "model.n_embd",
        format!("must be divisible by model.n_head ({}), got {}", m.n_head, m.n_embd),
    );
    check(
        (1..=MAX_VOCAB).contains(&m.vocab_size),
        "model.vocab_size",
        format!("must be in 1..={MAX_VOCAB} (token ids are uint32 at most), got {}", m.vocab_size),
    );
    check(
        (1..=MAX_PAD_VOCAB).contains(&m.pad_vocab_to),
        "model.pad_vocab_to",
        format!(
            "must be in 1..={MAX_PAD_VOCAB} (1: no padding; 64 aligns the LM head's matrix shapes), got {}",
            m.pad_vocab_to
        ),
    );
    check_arch(m, &mut check);
    // Rules that involve seq_len are judged against a valid one only (a bad one is reported here).
    let seq_ok = (1..=MAX_SEQ_LEN).contains(&m.seq_len);
    check(seq_ok, "model.seq_len", within(m.seq_len, MAX_SEQ_LEN));
    check((0.0..1.0).contains(&m.dropout), "model.dropout", format!("must be in [0, 1), got {}", m.dropout));

    check(
        !c.out_dir.as_os_str().is_empty(),
        "out_dir",
        "must name a directory (`.` for the current one), got an empty path".into(),
    );
    check_device(&c.device, &mut check);
    check_source(c, &mut check);
    let d = &c.data;
    // 0 holds nothing out: every token trains, and nothing is left to evaluate on.
    let evaluates = c.train.eval_interval > 0;
    let fraction_ok =
        (if evaluates { d.val_fraction > 0.0 } else { d.val_fraction >= 0.0 }) && d.val_fraction < 1.0;
    check(
        fraction_ok,
        "data.val_fraction",
        if evaluates && d.val_fraction == 0.0 {
            "must be above 0 while train.eval_interval evaluates (0 holds out no tokens to evaluate on: set train.eval_interval: 0 to train on every token)".into()
        } else {
            format!("must be in (0, 1), or 0 with train.eval_interval: 0, got {}", d.val_fraction)
        },
    );
    let synthetic = match d.sources.is_empty() {
        true => d.source == "synthetic",
        false => d.sources.iter().any(|s| s.source == "synthetic"),
    };
    if seq_ok && fraction_ok && synthetic {
        let needed = d.min_tokens(m.seq_len);
        check(
            d.synthetic_tokens >= needed,
            "data.synthetic_tokens",
            format!(
                "must be at least {needed} (with data.val_fraction {}, each split needs model.seq_len + 2 = {} tokens), got {}",
                d.val_fraction,
                m.seq_len + 2,
                d.synthetic_tokens
            ),
        );
    }

    let t = &c.train;
    check(
        t.global_batch_size >= 1,
        "train.global_batch_size",
        format!("must be at least 1, got {}", t.global_batch_size),
    );
    check(
        !seq_ok || (t.global_batch_size as u128) * (m.seq_len as u128) <= MAX_TOKENS_PER_STEP as u128,
        "train.global_batch_size",
        format!(
            "{} sequences of model.seq_len {} make more than {MAX_TOKENS_PER_STEP} tokens a step",
            t.global_batch_size, m.seq_len
        ),
    );
    check(
        t.micro_batch_size >= 1,
        "train.micro_batch_size",
        format!("must be at least 1, got {}", t.micro_batch_size),
    );
    check(
        t.micro_batch_size <= t.global_batch_size,
        "train.micro_batch_size",
        format!(
            "must not exceed train.global_batch_size ({}), got {}",
            t.global_batch_size, t.micro_batch_size
        ),
    );
    check(t.max_steps >= 1, "train.max_steps", format!("must be at least 1, got {}", t.max_steps));
    check(t.lr > 0.0 && t.lr.is_finite(), "train.lr", format!("must be a positive number, got {}", t.lr));
    check(
        // Only judged against a valid lr (a bad one is reported above); NaN counts as bad.
        t.lr.is_nan() || t.lr <= 0.0 || (t.min_lr >= 0.0 && t.min_lr <= t.lr),
        "train.min_lr",
        format!("must be in [0, train.lr = {}], got {}", t.lr, t.min_lr),
    );
    check(
        t.warmup_steps <= t.max_steps,
        "train.warmup_steps",
        format!(
            "must not exceed train.max_steps ({}), got {}: lower train.warmup_steps or raise train.max_steps",
            t.max_steps, t.warmup_steps
        ),
    );
    check(
        t.decay_fraction > 0.0 && t.decay_fraction <= 1.0,
        "train.decay_fraction",
        format!("must be in (0, 1], got {}", t.decay_fraction),
    );
    check(
        t.schedule != super::Schedule::Wsd || t.lr_decay_steps.is_none(),
        "train.lr_decay_steps",
        "is the cosine schedule's; train.schedule: wsd decays over train.decay_fraction of max_steps: remove one".into(),
    );
    if let Some(n) = t.lr_decay_steps {
        check(
            n > t.warmup_steps,
            "train.lr_decay_steps",
            format!(
                "must exceed train.warmup_steps ({}), got {n}: raise train.lr_decay_steps or lower train.warmup_steps",
                t.warmup_steps
            ),
        );
    }
    check(
        t.weight_decay >= 0.0 && t.weight_decay.is_finite(),
        "train.weight_decay",
        format!("must be a finite number >= 0, got {}", t.weight_decay),
    );
    check((0.0..1.0).contains(&t.beta1), "train.beta1", format!("must be in [0, 1), got {}", t.beta1));
    check((0.0..1.0).contains(&t.beta2), "train.beta2", format!("must be in [0, 1), got {}", t.beta2));
    // An infinite eps makes every Adam update 0: a run that trains nothing without a word.
    check(
        t.eps > 0.0 && t.eps.is_finite(),
        "train.eps",
        format!("must be a positive finite number, got {}", t.eps),
    );
    // fp16-mixed's loss scale: 0 or NaN skipped every update as an overflow, forever.
    check(
        t.loss_scale_initial.is_finite() && t.loss_scale_initial > 0.0,
        "train.loss_scale_initial",
        format!("must be a positive finite number, got {}", t.loss_scale_initial),
    );
    check(
        t.loss_scale_growth_interval >= 1,
        "train.loss_scale_growth_interval",
        "must be at least 1 (steps without an overflow before the scale doubles), got 0".to_string(),
    );
    check(t.grad_clip >= 0.0, "train.grad_clip", format!("must be >= 0 (0 = off), got {}", t.grad_clip));
    check(t.eval_batches >= 1, "train.eval_batches", format!("must be at least 1, got {}", t.eval_batches));
    check(t.log_interval >= 1, "train.log_interval", format!("must be at least 1, got {}", t.log_interval));
    if let Some(n) = t.threads {
        check(
            (1..=MAX_THREADS).contains(&n),
            "train.threads",
            format!("must be in 1..={MAX_THREADS}, got {n}"),
        );
    }

    if let Some(d) = &t.max_duration {
        if let Err(e) = super::parse_duration(d) {
            check(false, "train.max_duration", e);
        }
    }
    if let Some(m) = c.checkpoint.interval_minutes {
        let max = MAX_DURATION_S / 60.0;
        check(
            m > 0.0 && m <= max,
            "checkpoint.interval_minutes",
            format!("must be in (0, {max}] (100 years), got {m}"),
        );
    }
    // Without evaluation no loss is ever a best: the checkpoint asked to be kept would never be.
    check(
        !c.checkpoint.keep_best || evaluates,
        "checkpoint.keep_best",
        "keeps the checkpoint of the best validation loss, and train.eval_interval is 0 (nothing is evaluated): set train.eval_interval above 0, or keep_best: false".into(),
    );
    let tr = &c.metrics.trace;
    check(tr.steps >= 1, "metrics.trace.steps", format!("must be at least 1, got {}", tr.steps));
    // Steps count from 1: the last traced step, from + steps - 1, is at most train.max_steps.
    if let Some(from) = tr.from_step {
        let last = from.saturating_add(tr.steps).saturating_sub(1);
        check(from >= 1, "metrics.trace.from_step", format!("steps count from 1, got {from}"));
        check(
            last <= t.max_steps,
            "metrics.trace.from_step",
            format!(
                "the traced steps {from}–{last} end past the run's last step, {} (train.max_steps): pick an earlier step or fewer metrics.trace.steps",
                t.max_steps
            ),
        );
    }
    let ev = &c.eval;
    for (i, task) in ev.tasks.iter().enumerate() {
        if let Err(why) = check_task_name(&task.name) {
            check(false, &format!("eval.tasks[{i}].name"), why);
        }
        if ev.tasks[..i].iter().any(|t| t.name == task.name) {
            check(
                false,
                &format!("eval.tasks[{i}].name"),
                format!("`{}` names two tasks: each needs its own name", task.name),
            );
        }
        check(
            !task.path.as_os_str().is_empty(),
            &format!("eval.tasks[{i}].path"),
            "expected the task's JSONL file (HellaSwag's layout: `ctx`, `endings`, `label`)".into(),
        );
    }
    check(
        ev.every_steps != Some(0),
        "eval.every_steps",
        "must be at least 1 (leave it unset to score the tasks when validation runs), got 0".into(),
    );
    check(
        ev.max_examples != Some(0),
        "eval.max_examples",
        "must be at least 1 (unset: every example), got 0".into(),
    );
    check(
        ev.tasks.is_empty() || ev.every_steps.is_some() || evaluates,
        "eval.tasks",
        "are scored when validation runs by default, and train.eval_interval is 0: set eval.every_steps, or train.eval_interval above 0".into(),
    );
    check(
        c.nan.max_consecutive >= 1,
        "nan.max_consecutive",
        format!("must be at least 1, got {}", c.nan.max_consecutive),
    );
    check_divergence(c, &mut check);

    match super::Checkpointing::parse(&c.memory.activation_checkpointing) {
        Err(e) => check(false, "memory.activation_checkpointing", e),
        Ok(super::Checkpointing::First(m)) => check(
            m <= c.model.n_layer,
            "memory.activation_checkpointing",
            format!(
                "first_n:{m} names more blocks than model.n_layer ({}); `blocks` checkpoints them all",
                c.model.n_layer
            ),
        ),
        Ok(_) => {}
    }
    if let Some(n) = c.memory.loss_chunk_tokens {
        check(
            (1..=MAX_TOKENS_PER_STEP).contains(&n),
            "memory.loss_chunk_tokens",
            format!("must be in 1..={MAX_TOKENS_PER_STEP}, got {n}"),
        );
    }
    check(
        (0.0..1.0).contains(&c.optimizer.momentum),
        "optimizer.momentum",
        format!("must be in [0, 1), got {}", c.optimizer.momentum),
    );
    let o = &c.optimizer;
    check(
        o.muon_lr.is_finite() && o.muon_lr > 0.0,
        "optimizer.muon_lr",
        format!("must be a positive number, got {}", o.muon_lr),
    );
    check(
        (0.0..1.0).contains(&o.muon_momentum),
        "optimizer.muon_momentum",
        format!("must be in [0, 1), got {}", o.muon_momentum),
    );
    check(
        (1..=20).contains(&o.muon_ns_steps),
        "optimizer.muon_ns_steps",
        format!("must be in 1..=20, got {}", o.muon_ns_steps),
    );
    for problem in c.memory.allocator.problems() {
        check(false, &problem.key, problem.message);
    }

    // A week at most: the heartbeat's periods and the fence's notices are multiples of it (and
    // c10d takes it in milliseconds), which a value near 2^64 would overflow.
    check(
        (1..=MAX_DIST_TIMEOUT_S).contains(&c.dist.timeout_s),
        "dist.timeout_s",
        format!("must be in 1..={MAX_DIST_TIMEOUT_S} (a week), got {}", c.dist.timeout_s),
    );
    check(c.dist.bucket_mb > 0.0, "dist.bucket_mb", format!("must be > 0, got {}", c.dist.bucket_mb));
    check(
        c.dist.writer_wait_s != Some(0),
        "dist.writer_wait_s",
        "must be at least 1 (seconds), or left out to wait as long as rank 0 is alive, got 0".to_string(),
    );

    let o = &c.oom;
    check(
        o.min_micro_batch >= 1,
        "oom.min_micro_batch",
        format!("must be at least 1, got {}", o.min_micro_batch),
    );
    check(
        t.micro_batch_size == 0 || o.min_micro_batch <= t.micro_batch_size,
        "oom.min_micro_batch",
        format!("must not exceed train.micro_batch_size ({}), got {}", t.micro_batch_size, o.min_micro_batch),
    );
    if let Some(limit) = &c.memory.limit {
        // `--set memory.limit=16` meant 16 GiB: a number without a unit is bytes.
        let unitless = match limit {
            crate::config::Size::Bytes(_) => true,
            crate::config::Size::Text(t) => t.trim().bytes().all(|c| c.is_ascii_digit()),
        };
        match limit.bytes() {
            Err(e) => check(false, "memory.limit", e),
            Ok(b) if unitless && b < 1 << 20 => check(
                false,
                "memory.limit",
                format!("{b} is {b} bytes (a number without a unit is bytes); give a unit, e.g. {b}GiB"),
            ),
            Ok(_) => {}
        }
    }
    let leak = c.memory.leak_check_steps;
    check(
        leak != 1,
        "memory.leak_check_steps",
        "must be 0 (off) or at least 2: growth is measured between steps, got 1".into(),
    );
    check_cuda_graphs(c, &mut check);
    check_document_mask(c, &mut check);
    check_faults(c, &mut check);
    p.extend(super::notify::check(&c.notify).into_iter().map(|(key, why)| Problem::new(key, why)));
    p
}

/// An injected fault that could never happen would let a test of it pass without it: a fault
/// inside a step names a step the run reaches (steps count from 1 to train.max_steps), a stop
/// or crash "once N steps are done" an N the run reaches before its end (0..train.max_steps),
/// and an overflow needs fp16's loss scaler to see it. The ranks are checked against the world
/// size in the run plan.
fn check_faults(c: &Config, check: &mut impl FnMut(bool, &str, String)) {
    let (f, max) = (&c.faults, c.train.max_steps);
    let never = |s: u64| {
        format!("step {s} is never run (steps are 1..={max}, train.max_steps = {max}), so the fault would not happen")
    };
    let never_done = |s: u64| {
        format!("{s} steps are never done before the run ends (train.max_steps = {max}), so the fault would not happen")
    };
    for (key, done) in
        [("faults.interrupt_at_step", f.interrupt_at_step), ("faults.crash_at_step", f.crash_at_step)]
    {
        if let Some(s) = done {
            check(s < max, key, never_done(s));
        }
    }
    let inside = [
        ("faults.nondeterministic_op_at_step", f.nondeterministic_op_at_step),
        ("faults.failing_scalar_op_at_step", f.failing_scalar_op_at_step),
    ];
    for (key, step) in inside {
        if let Some(s) = step {
            check((1..=max).contains(&s), key, never(s));
        }
    }
    for (key, steps) in [
        ("faults.nonfinite_loss_at_steps", &f.nonfinite_loss_at_steps),
        ("faults.fp16_overflow_at_steps", &f.fp16_overflow_at_steps),
    ] {
        for (i, &s) in steps.iter().enumerate() {
            check((1..=max).contains(&s), &format!("{key}[{i}]"), never(s));
        }
    }
    check(
        f.fp16_overflow_at_steps.is_empty() || c.precision == super::Precision::Fp16Mixed,
        "faults.fp16_overflow_at_steps",
        format!(
            "needs precision: fp16-mixed (only its loss scaler meets overflows), got {}",
            c.precision.name()
        ),
    );
}

/// `kernels.cuda_graphs` captures a micro-step once and replays it: each setting that changes
/// it from step to step, or takes it through host memory, is named.
fn check_cuda_graphs(c: &Config, check: &mut impl FnMut(bool, &str, String)) {
    if !c.kernels.cuda_graphs {
        return;
    }
    let why = "kernels.cuda_graphs captures a micro-step once and replays it";
    check(c.model.dropout == 0.0, "model.dropout", format!("must be 0 with kernels.cuda_graphs (dropout reseeds the generator per block, which a replayed graph cannot; {why}), got {}", c.model.dropout));
    check(
        c.precision != super::Precision::Fp16Mixed,
        "precision",
        format!("fp16-mixed cannot run with kernels.cuda_graphs (its loss scale changes from step to step; {why}): use bf16-mixed"),
    );
    check(
        !c.memory.offload_activations,
        "memory.offload_activations",
        format!("must be false with kernels.cuda_graphs (offload copies through host memory; {why}); checkpointing and a chunked loss can be graphed"),
    );
    check(
        !c.oom.escalate.contains(&super::Escalation::ShardParameters),
        "oom.escalate",
        format!("`shard_parameters` cannot run with kernels.cuda_graphs (each block's weights are gathered from the other ranks inside the micro-step; {why}): use `shard_gradients`, or set kernels.cuda_graphs false"),
    );
    check(
        c.dist.shard != super::ShardLevel::Parameters,
        "dist.shard",
        format!("`parameters` cannot run with kernels.cuda_graphs (each block's weights are gathered from the other ranks inside the micro-step; {why}): use `gradients`, or set kernels.cuda_graphs false"),
    );
}

/// `data.document_mask` and `data.eos_id`: an id the embedding has; a mask that CUDA graphs
/// cannot replay (document lengths change every batch, and finding them is a host sync).
fn check_document_mask(c: &Config, check: &mut impl FnMut(bool, &str, String)) {
    if let Some(id) = c.data.eos_id {
        check(
            (id as usize) < c.model.vocab_size,
            "data.eos_id",
            format!("must be below model.vocab_size ({}), got {id}", c.model.vocab_size),
        );
    }
    check(
        !(c.data.document_mask && c.kernels.cuda_graphs),
        "data.document_mask",
        "cannot run with kernels.cuda_graphs: the documents' lengths change every batch and are read back to the host, which a replayed graph cannot do; set one of them false".into(),
    );
}

fn check_device(device: &str, check: &mut impl FnMut(bool, &str, String)) {
    let ok = match device {
        "auto" | "cpu" | "cuda" => true,
        d => d.strip_prefix("cuda:").is_some_and(|n| n.parse::<usize>().is_ok()),
    };
    check(ok, "device", format!("must be auto, cpu, cuda or cuda:N, got `{device}`"));
}

/// Shapes each architecture can build.
fn check_arch(m: &super::ModelConfig, check: &mut impl FnMut(bool, &str, String)) {
    let kv = m.kv_heads();
    match m.arch {
        super::Arch::Gpt2 => {
            check(kv == m.n_head, "model.n_kv_head", format!("gpt2 has no grouped-query attention: leave it unset or equal to model.n_head ({}), got {kv}", m.n_head));
            check(
                m.tie_embeddings,
                "model.tie_embeddings",
                "gpt2 always ties its head to the token embedding: must be true".into(),
            );
        }
        super::Arch::Llama => {
            check(
                m.ffn_hidden.is_some(),
                "model.ffn_hidden",
                "llama needs its SwiGLU width (e.g. 8192 for Llama 3.2 1B)".into(),
            );
            check(m.n_head > 0 && m.n_embd.is_multiple_of(m.n_head) && m.head_dim().is_multiple_of(2), "model.n_embd", format!("llama's rotary embedding needs an even head size: n_embd / n_head = {} / {} must be an even integer", m.n_embd, m.n_head));
            check(
                m.rope_theta > 0.0 && m.rope_theta.is_finite(),
                "model.rope_theta",
                format!("must be a positive number, got {}", m.rope_theta),
            );
            check(
                m.norm_eps > 0.0 && m.norm_eps.is_finite(),
                "model.norm_eps",
                format!("must be a positive number, got {}", m.norm_eps),
            );
        }
    }
    if m.n_head >= 1 {
        check(
            kv >= 1 && m.n_head.is_multiple_of(kv),
            "model.n_kv_head",
            format!("must be at least 1 and divide model.n_head ({}), got {kv}", m.n_head),
        );
    }
    if let Some(f) = m.ffn_hidden {
        check((1..=MAX_FFN).contains(&f), "model.ffn_hidden", format!("must be in 1..={MAX_FFN}, got {f}"));
    }
}

/// Padding beyond this would only waste memory (GPU kernels want multiples of 8 to 128).
const MAX_PAD_VOCAB: usize = 1 << 16;

fn check_source(c: &Config, check: &mut impl FnMut(bool, &str, String)) {
    let d = &c.data;
    if d.sources.is_empty() {
        check_one_source(&d.source, "data.source", c.model.vocab_size, check);
        return;
    }
    check(
        d.source == "synthetic",
        "data.source",
        format!("cannot be set together with data.sources (got `{}`): give the one source as data.sources' only entry, or drop data.sources", d.source),
    );
    let mut names = std::collections::BTreeMap::new();
    for (i, s) in d.sources.iter().enumerate() {
        check_one_source(&s.source, &format!("data.sources[{i}].source"), c.model.vocab_size, check);
        check(
            s.weight.is_finite() && s.weight > 0.0,
            &format!("data.sources[{i}].weight"),
            format!(
                "must be a positive finite number (a share relative to the other sources'), got {}",
                s.weight
            ),
        );
        let label = s.label();
        check(
            !label.is_empty() && !label.contains(char::is_whitespace),
            &format!("data.sources[{i}].name"),
            format!("must be a non-empty name without spaces, got `{label}`"),
        );
        if let Some(first) = names.insert(label.clone(), i) {
            check(
                false,
                &format!("data.sources[{i}].name"),
                format!("`{label}` names data.sources[{first}] already: give each source its own name"),
            );
        }
    }
    // Bytes and a tokenizer's ids are two vocabularies: one model cannot read both.
    if let Some(t) = d.sources.iter().position(|s| s.source.starts_with("tokens:")) {
        if let Some(x) = d.sources.iter().position(|s| s.source.starts_with("text:")) {
            check(
                false,
                &format!("data.sources[{x}].source"),
                format!("a text: source (bytes as ids) cannot be mixed with data.sources[{t}]'s tokens: (a tokenizer's ids): prepare the text with the same tokenizer (trainguard prepare) and give it as tokens:"),
            );
        }
    }
    let total: f64 = d.sources.iter().map(|s| s.weight).sum();
    let each_ok = d.sources.iter().all(|s| s.weight.is_finite() && s.weight > 0.0);
    check(
        !each_ok || total.is_finite(),
        "data.sources",
        format!("the weights must sum to a finite positive number, got {total}"),
    );
}

/// One `synthetic | text:<path> | tokens:<path>` under config key `key`.
fn check_one_source(source: &str, key: &str, vocab_size: usize, check: &mut impl FnMut(bool, &str, String)) {
    if source == "synthetic" {
        return;
    }
    let Some((kind, path)) = source.split_once(':') else {
        check(false, key, format!("must be synthetic, text:<path> or tokens:<path>, got `{source}`"));
        return;
    };
    match kind {
        // Which files a tokens: path names (a prepare directory, shards, a glob) is the data
        // module's to say: the run plan checks that they exist.
        "tokens" => {
            check(!path.is_empty(), key, "tokens: needs a path: tokens:<file, directory or glob>".into())
        }
        // Whether the file exists is the run plan's to check, as for tokens:.
        "text" => {
            check(!path.is_empty(), key, "text: needs a path: text:<file>".into());
            check(
                vocab_size >= 256,
                "model.vocab_size",
                format!("must be at least 256 for text: sources (byte tokens), got {vocab_size}"),
            );
        }
        "synthetic" => {
            check(false, key, format!("synthetic takes no path: write `synthetic`, got `{source}`"))
        }
        _ => check(
            false,
            key,
            format!("unknown source kind `{kind}`: use synthetic, text:<path> or tokens:<path>"),
        ),
    }
}

/// `eval.tasks[i].name`: it names metrics fields (`eval_NAME_acc`), so 1 to 64 letters, digits,
/// `_` or `-`. Here, not in `eval`, so that the config does not depend on what it configures.
pub fn check_task_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    match ok {
        true => Ok(()),
        false => Err(format!(
            "a task name is 1 to 64 letters, digits, `_` or `-` (it names metrics fields), got {name:?}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(c: &Config) -> Vec<String> {
        validate(c).into_iter().map(|p| p.key).collect()
    }

    fn task(name: &str, path: &str) -> crate::config::EvalTask {
        crate::config::EvalTask { name: name.into(), path: path.into() }
    }

    #[test]
    fn defaults_are_valid() {
        assert!(validate(&Config::default()).is_empty());
    }

    #[test]
    fn faults_that_could_never_happen_are_refused() {
        let mut c = Config::default(); // max_steps 200
        c.faults.interrupt_at_step = Some(199);
        c.faults.nonfinite_loss_at_steps = vec![1, 200];
        assert!(keys(&c).is_empty());
        c.faults.interrupt_at_step = Some(200);
        c.faults.crash_at_step = Some(500);
        c.faults.nonfinite_loss_at_steps = vec![0, 3, 201];
        assert_eq!(
            keys(&c),
            [
                "faults.interrupt_at_step",
                "faults.crash_at_step",
                "faults.nonfinite_loss_at_steps[0]",
                "faults.nonfinite_loss_at_steps[2]"
            ]
        );
        assert!(validate(&c)[2].message.contains("steps are 1..=200"), "{:?}", validate(&c));
        let mut c = Config::default();
        c.faults.fp16_overflow_at_steps = vec![2];
        assert_eq!(keys(&c), ["faults.fp16_overflow_at_steps"]);
        c.precision = crate::config::Precision::Fp16Mixed;
        assert!(keys(&c).is_empty());
    }

    #[test]
    fn each_model_rule_names_its_key() {
        let mut c = Config::default();
        c.model.n_layer = 0;
        assert_eq!(keys(&c), ["model.n_layer"]);
        let mut c = Config::default();
        c.model.n_embd = 65;
        assert_eq!(keys(&c), ["model.n_embd"]);
        let mut c = Config::default();
        c.model.vocab_size = 0;
        assert_eq!(keys(&c), ["model.vocab_size"]);
        let mut c = Config::default();
        c.model.vocab_size = 128_256;
        assert!(keys(&c).is_empty(), "vocabularies above uint16 are fine (Llama 3)");
        for bad in [0, (1 << 16) + 1] {
            let mut c = Config::default();
            c.model.pad_vocab_to = bad;
            assert_eq!(keys(&c), ["model.pad_vocab_to"]);
        }
        let mut c = Config::default();
        c.model.dropout = 1.0;
        assert_eq!(keys(&c), ["model.dropout"]);
        let mut c = Config::default();
        c.model.n_head = 0;
        assert_eq!(keys(&c), ["model.n_head"]);
    }

    #[test]
    fn every_token_may_train_only_where_nothing_is_evaluated() {
        let mut c = Config::default();
        c.data.val_fraction = 0.0;
        let p = validate(&c);
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(
            p[0].to_string()
                .starts_with("data.val_fraction: must be above 0 while train.eval_interval evaluates"),
            "{}",
            p[0]
        );
        c.train.eval_interval = 0;
        assert!(validate(&c).is_empty(), "{:?}", validate(&c));
        c.data.val_fraction = -0.1;
        assert!(validate(&c)[0]
            .to_string()
            .contains("must be in (0, 1), or 0 with train.eval_interval: 0, got -0.1"));
    }

    #[test]
    fn each_train_rule_names_its_key() {
        type Case = (fn(&mut Config), &'static str);
        let cases: Vec<Case> = vec![
            (|c| c.train.micro_batch_size = 0, "train.micro_batch_size"),
            (|c| c.train.micro_batch_size = 64, "train.micro_batch_size"),
            (
                |c| {
                    c.train.max_steps = 0;
                    c.train.warmup_steps = 0
                },
                "train.max_steps",
            ),
            (|c| c.train.lr = -1.0, "train.lr"),
            (|c| c.train.min_lr = 1.0, "train.min_lr"),
            (|c| c.train.warmup_steps = 1000, "train.warmup_steps"),
            (|c| c.train.lr_decay_steps = Some(5), "train.lr_decay_steps"),
            (|c| c.train.weight_decay = -0.1, "train.weight_decay"),
            (|c| c.train.beta2 = 1.0, "train.beta2"),
            (|c| c.train.grad_clip = -1.0, "train.grad_clip"),
            (|c| c.train.log_interval = 0, "train.log_interval"),
            (|c| c.train.eval_batches = 0, "train.eval_batches"),
            (|c| c.data.val_fraction = 0.0, "data.val_fraction"),
            (|c| c.data.source = "csv:x".into(), "data.source"),
            (|c| c.data.source = "tokens:".into(), "data.source"),
            (|c| c.data.source = "synthetic:x".into(), "data.source"),
            (|c| c.device = "tpu".into(), "device"),
            (|c| c.device = "cuda:x".into(), "device"),
            (|c| c.oom.min_micro_batch = 16, "oom.min_micro_batch"),
            (|c| c.oom.min_micro_batch = 0, "oom.min_micro_batch"),
            (|c| c.model.seq_len = 0, "model.seq_len"),
            (|c| c.model.n_embd = 0, "model.n_embd"),
            (|c| c.data.synthetic_tokens = 10, "data.synthetic_tokens"),
            (|c| c.data.eos_id = Some(1 << 20), "data.eos_id"),
            (
                |c| {
                    c.data.document_mask = true;
                    c.kernels.cuda_graphs = true
                },
                "data.document_mask",
            ),
            (|c| c.memory.leak_check_steps = 1, "memory.leak_check_steps"),
            (|c| c.train.beta1 = 1.0, "train.beta1"),
            (|c| c.train.eps = 0.0, "train.eps"),
            (|c| c.train.threads = Some(0), "train.threads"),
            (|c| c.train.threads = Some(100_000), "train.threads"),
            (|c| c.data.source = "text:".into(), "data.source"),
            (|c| c.train.max_duration = Some("soon".into()), "train.max_duration"),
            (
                |c| {
                    c.checkpoint.keep_best = true;
                    c.train.eval_interval = 0;
                    c.data.val_fraction = 0.0
                },
                "checkpoint.keep_best",
            ),
            (|c| c.checkpoint.interval_minutes = Some(0.0), "checkpoint.interval_minutes"),
            (|c| c.checkpoint.interval_minutes = Some(f64::INFINITY), "checkpoint.interval_minutes"),
            (|c| c.checkpoint.interval_minutes = Some(f64::NAN), "checkpoint.interval_minutes"),
            (|c| c.out_dir = "".into(), "out_dir"),
            (|c| c.model.n_layer = usize::MAX, "model.n_layer"),
            (|c| c.model.n_embd = 1 << 20, "model.n_embd"),
            (|c| c.model.seq_len = usize::MAX, "model.seq_len"),
            (|c| c.train.global_batch_size = usize::MAX, "train.global_batch_size"),
            (|c| c.train.max_duration = Some("99999999999999999999s".into()), "train.max_duration"),
            (|c| c.nan.max_consecutive = 0, "nan.max_consecutive"),
            (|c| c.divergence.window = 2, "divergence.window"),
            (|c| c.divergence.min_history = 101, "divergence.min_history"),
            (|c| c.divergence.threshold = f64::NAN, "divergence.threshold"),
            (|c| c.divergence.min_rise = -0.1, "divergence.min_rise"),
            (|c| c.divergence.grad_norm_threshold = Some(0.0), "divergence.grad_norm_threshold"),
            (|c| c.divergence.rollback_window = 0, "divergence.rollback_window"),
            (|c| c.divergence.lr_factor = 2.0, "divergence.lr_factor"),
            (
                |c| {
                    c.divergence.enabled = true;
                    c.checkpoint.interval = 0;
                },
                "divergence.enabled",
            ),
            (
                |c| c.faults.lr_spike = Some(crate::config::LrSpikeFault { data_step: 0, factor: 10.0 }),
                "faults.lr_spike.data_step",
            ),
            (|c| c.dist.timeout_s = 0, "dist.timeout_s"),
            (|c| c.dist.timeout_s = u64::MAX, "dist.timeout_s"),
            (|c| c.dist.writer_wait_s = Some(0), "dist.writer_wait_s"),
            (|c| c.memory.activation_checkpointing = "sometimes".into(), "memory.activation_checkpointing"),
            (|c| c.memory.activation_checkpointing = "every_n:0".into(), "memory.activation_checkpointing"),
            (|c| c.memory.activation_checkpointing = "first_n:3".into(), "memory.activation_checkpointing"),
            (|c| c.memory.activation_checkpointing = "first_n:0".into(), "memory.activation_checkpointing"),
            (|c| c.memory.loss_chunk_tokens = Some(0), "memory.loss_chunk_tokens"),
            (|c| c.memory.loss_chunk_tokens = Some(1 << 63), "memory.loss_chunk_tokens"),
            (|c| c.train.loss_scale_initial = 0.0, "train.loss_scale_initial"),
            (|c| c.train.loss_scale_initial = f64::NAN, "train.loss_scale_initial"),
            (|c| c.train.loss_scale_growth_interval = 0, "train.loss_scale_growth_interval"),
            (|c| c.optimizer.momentum = 1.5, "optimizer.momentum"),
            (|c| c.optimizer.muon_lr = 0.0, "optimizer.muon_lr"),
            (|c| c.optimizer.muon_momentum = 1.0, "optimizer.muon_momentum"),
            (|c| c.optimizer.muon_ns_steps = 0, "optimizer.muon_ns_steps"),
            (|c| c.dist.bucket_mb = 0.0, "dist.bucket_mb"),
            (|c| c.memory.limit = Some(crate::config::Size::Text("lots".into())), "memory.limit"),
            (|c| c.memory.limit = Some(crate::config::Size::Bytes(16)), "memory.limit"),
            (|c| c.memory.limit = Some(crate::config::Size::Text("16".into())), "memory.limit"),
            (
                |c| c.memory.limit = Some(crate::config::Size::Text("99999999999999999999GiB".into())),
                "memory.limit",
            ),
            (|c| c.train.eps = f64::INFINITY, "train.eps"),
            (|c| c.train.weight_decay = f64::INFINITY, "train.weight_decay"),
            (|c| c.metrics.trace.steps = 0, "metrics.trace.steps"),
            (|c| c.metrics.trace.from_step = Some(c.train.max_steps), "metrics.trace.from_step"),
            (|c| c.eval.tasks = vec![task("hella swag", "t.jsonl")], "eval.tasks[0].name"),
            (|c| c.eval.tasks = vec![task("a", "t.jsonl"), task("a", "u.jsonl")], "eval.tasks[1].name"),
            (|c| c.eval.tasks = vec![task("a", "")], "eval.tasks[0].path"),
            (|c| c.eval.every_steps = Some(0), "eval.every_steps"),
            (|c| c.eval.max_examples = Some(0), "eval.max_examples"),
            (
                |c| {
                    c.eval.tasks = vec![task("a", "t.jsonl")];
                    c.train.eval_interval = 0;
                },
                "eval.tasks",
            ),
        ];
        for (mutate, key) in cases {
            let mut c = Config::default();
            mutate(&mut c);
            assert_eq!(keys(&c), [key], "rule for {key}");
        }
    }

    #[test]
    fn a_trace_past_the_end_names_the_steps_traced_and_the_last_one() {
        let mut c = Config::default();
        (c.train.max_steps, c.metrics.trace.from_step, c.metrics.trace.steps) = (8, Some(7), 5);
        let said: Vec<String> = validate(&c).iter().map(ToString::to_string).collect();
        assert!(
            said.iter().any(
                |p| p.contains("the traced steps 7–11 end past the run's last step, 8 (train.max_steps)")
            ),
            "{said:?}"
        );
        c.metrics.trace.steps = 2;
        assert!(
            !keys(&c).iter().any(|k| k == "metrics.trace.from_step"),
            "steps 7 and 8, the run's last, may be traced: {:?}",
            keys(&c)
        );
        c.metrics.trace.from_step = Some(0);
        assert!(keys(&c).iter().any(|k| k == "metrics.trace.from_step"), "steps count from 1");
    }

    #[test]
    fn impossible_llama_shapes_name_their_keys() {
        let llama = || {
            let mut c = Config::default();
            c.model.arch = crate::config::Arch::Llama;
            c.model.ffn_hidden = Some(172);
            c.model.n_head = 4;
            c.model.n_kv_head = Some(2);
            c
        };
        assert!(keys(&llama()).is_empty());
        let mut c = llama();
        c.model.n_kv_head = Some(3);
        assert_eq!(keys(&c), ["model.n_kv_head"], "3 does not divide 4 heads");
        let mut c = llama();
        c.model.n_head = 32; // head size 2 is even; 64 / 64 = 1 is odd
        c.model.n_kv_head = Some(8);
        c.model.n_embd = 32 * 3;
        assert_eq!(keys(&c), ["model.n_embd"], "odd head size for RoPE");
        let mut c = llama();
        c.model.ffn_hidden = None;
        c.model.rope_theta = 0.0;
        assert_eq!(keys(&c), ["model.ffn_hidden", "model.rope_theta"]);
        let mut c = Config::default();
        c.model.n_kv_head = Some(1);
        c.model.tie_embeddings = false;
        assert_eq!(keys(&c), ["model.n_kv_head", "model.tie_embeddings"], "gpt2 has neither");
    }

    #[test]
    fn text_sources_need_a_byte_vocabulary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.txt");
        std::fs::write(&p, "hello").unwrap();
        let mut c = Config::default();
        c.data.source = format!("text:{}", p.display());
        assert!(validate(&c).is_empty());
        c.model.vocab_size = 100;
        assert_eq!(keys(&c), ["model.vocab_size"]);
    }

    #[test]
    fn a_mixture_names_the_entry_and_field_at_fault() {
        let source =
            |s: &str, weight: f64| crate::config::SourceConfig { source: s.into(), weight, name: None };
        let mut c = Config::default();
        c.data.sources = vec![source("tokens:/d/web", 0.8), source("synthetic", 0.2)];
        assert!(validate(&c).is_empty(), "{:?}", validate(&c));
        c.data.sources[1].weight = 0.0;
        assert_eq!(keys(&c), ["data.sources[1].weight"]);
        c.data.sources[0].weight = -1.0;
        c.data.sources[1].weight = f64::NAN;
        assert_eq!(keys(&c), ["data.sources[0].weight", "data.sources[1].weight"]);
        let msg = validate(&c)[0].to_string();
        assert!(
            msg.contains("data.sources[0].weight: must be a positive finite number")
                && msg.contains("got -1"),
            "{msg}"
        );
        c.data.sources = vec![source("csv:x", 1.0), source("tokens:", 1.0)];
        assert_eq!(keys(&c), ["data.sources[0].source", "data.sources[1].source"]);
        // Both ways of naming the data at once: refused, naming both keys.
        c.data.sources = vec![source("tokens:/d/web", 1.0)];
        c.data.source = "tokens:/d/code".into();
        let p = validate(&c);
        assert_eq!(p.len(), 1);
        assert!(
            p[0].to_string().starts_with("data.source: cannot be set together with data.sources"),
            "{}",
            p[0]
        );
        // Two sources that would share a name in the metrics.
        c.data.source = "synthetic".into();
        c.data.sources = vec![source("tokens:/a/web", 1.0), source("tokens:/b/web", 1.0)];
        assert_eq!(keys(&c), ["data.sources[1].name"]);
        c.data.sources[1].name = Some("web_b".into());
        assert!(validate(&c).is_empty());
        // Bytes beside a tokenizer's ids: refused, naming the text entry.
        c.data.sources = vec![source("tokens:/a/web", 1.0), source("text:/b/code.txt", 1.0)];
        assert_eq!(keys(&c), ["data.sources[1].source"]);
        assert_eq!(c.data.primary_source(), "tokens:/a/web");
        // The synthetic corpus' size is checked when a mixture uses it.
        c.data.sources[0].source = "synthetic".into();
        c.data.synthetic_tokens = 10;
        assert_eq!(keys(&c), ["data.synthetic_tokens"]);
    }

    #[test]
    fn cuda_graphs_name_each_setting_they_cannot_replay() {
        let mut c = Config::default();
        c.kernels.cuda_graphs = true;
        c.memory.activation_checkpointing = "blocks".into();
        c.memory.loss_chunk_tokens = Some(1024);
        assert!(keys(&c).is_empty(), "checkpointing and a chunked loss can be graphed: {:?}", keys(&c));
        c.model.dropout = 0.1;
        c.precision = crate::config::Precision::Fp16Mixed;
        c.memory.offload_activations = true;
        assert_eq!(keys(&c), ["model.dropout", "precision", "memory.offload_activations"]);
        c.kernels.cuda_graphs = false;
        assert!(keys(&c).is_empty(), "without graphs all of them are fine");
    }

    #[test]
    fn all_problems_are_reported_at_once() {
        let mut c = Config::default();
        c.model.n_layer = 0;
        c.train.log_interval = 0;
        c.device = "gpu".into();
        let k = keys(&c);
        assert_eq!(k.len(), 3, "{k:?}");
    }

    #[test]
    fn cuda_devices_parse() {
        for d in ["auto", "cpu", "cuda", "cuda:0", "cuda:7"] {
            let c = Config { device: d.into(), ..Config::default() };
            assert!(validate(&c).is_empty(), "{d}");
        }
    }
}
