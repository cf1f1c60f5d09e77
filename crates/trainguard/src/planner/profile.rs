//! `--profile`: measures what the estimate predicts. Builds the real model and the configured
//! optimizer on the device, runs a few real steps (forward, backward, clipping, update) at each
//! micro-batch inside the OOM guard (`oom.policy: fail`, so an out-of-memory is an answer —
//! "does not fit" — never a crash), with the config's memory savers, reads the peak, and fits
//! fixed + per-sample cost by least squares. Without an explicit list of sizes it finds the
//! largest micro-batch that fits by measurement: doubling, then bisection, within the safety
//! margin.
//!
//! What "peak" means:
//! - CUDA: the caching allocator's `allocated_peak` (reset before each size) above what was
//!   allocated before the model was built; fitting is judged on `reserved_peak` plus what the
//!   device had in use before (the CUDA context and other processes).
//! - CPU (the analogue): the process's peak resident set (VmHWM, reset by writing 5 to
//!   `/proc/self/clear_refs`) above the resident size before the model was built; glibc is set
//!   to return large blocks at once (as under `memory.limit`) so the figure is reproducible. Where
//!   `clear_refs` cannot be written each size runs in a child process of the same binary. This
//!   is not the CUDA figure: no context, no caching allocator; the estimate it is compared with
//!   is the one for the CPU target (the parts that apply: weights, gradients, optimizer state,
//!   activations, logits and cross-entropy).
//!
//! Each measured step accumulates [`ACCUMULATION`] micro-batches, so the gradients of the first
//! are held while the second runs: the peak of any run that accumulates.
use super::estimate::estimate;
use super::recommend::largest_fitting;
use super::shape::{Setup, Transformer};
use crate::config::OomPolicy;
use crate::data::{Corpus, DataError, Sampler};
use crate::events::Reporter;
use crate::ffi::{self, ShimError};
use crate::guard::{Guard, GuardError, GuardState};
use crate::memory::{self, LimitError, ProcessMemory};
use crate::run_plan::RunPlan;
use crate::step::{optimizer_step, Faults, StepData, Trainable};
use serde::{Deserialize, Serialize};
use tch::{Device, TchError};

/// Micro-steps in each measured step.
pub const ACCUMULATION: u64 = 2;

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error(transparent)]
    Data(#[from] DataError),
    #[error("libtorch: {0}")]
    Torch(#[from] TchError),
    #[error(transparent)]
    Limit(#[from] LimitError),
    #[error("allocator statistics: {0}")]
    Shim(#[from] ShimError),
    #[error("cannot read this process's memory from /proc/self/status")]
    NoProcStatus,
    #[error("profile step: {0}")]
    Step(String),
    #[error("cannot reset the peak resident size through /proc/self/clear_refs: {0}")]
    ResetPeak(std::io::Error),
    /// Not even the model, its optimizer and libtorch's set-up fit: no micro-batch can.
    #[error("nothing fits, not even micro-batch 1: the model and its optimizer alone ran out of memory under the profile's cap of {} (memory.limit, --gpu or --gpu-memory); raise the cap or shrink the model (docs/memory-and-precision.md)", crate::memory::human(*.cap))]
    SetupOutOfMemory { cap: u64 },
    #[error(transparent)]
    Documents(#[from] crate::model::documents::DocumentsError),
    #[error("child process for micro-batch {micro}: {why}")]
    Child { micro: u64, why: String },
}

/// How one size went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Fits,
    /// Ran, but above the budget.
    OverBudget,
    /// Ran within the budget, but the CUDA caching allocator had to free its cache and retry:
    /// training at that size would do it every step (an H200 at 97% of its memory: 123 retries
    /// in 40 steps, 260k tokens/s where half the micro-batch without retries ran at 405k).
    Retries,
    /// The allocator refused; the guard caught it.
    OutOfMemory,
}

/// One size's raw measurement (also what a child process prints).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Measured {
    /// Peak above the baseline (none when out of memory).
    pub peak: Option<u64>,
    /// CUDA: reserved peak plus what was in use before the model (context, other processes).
    pub device_used: Option<u64>,
    /// CUDA: the caching allocator's retries (cache freed, allocation tried again) in these steps.
    #[serde(default)]
    pub retries: u64,
    pub oom: bool,
    /// How the measured steps went, as training counts them.
    #[serde(default)]
    pub steps: StepCounts,
}

/// What the measured optimizer steps did: they are training's steps (loss scaling, the
/// non-finite check, injected `faults.*`), so a skipped update is skipped here too.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct StepCounts {
    pub applied: u64,
    /// Not applied: a non-finite loss or gradient norm (fp16 overflows included).
    pub skipped: u64,
    /// fp16-mixed: the loss scale after the last step.
    pub loss_scale: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Point {
    pub micro_batch: u64,
    pub estimate_bytes: u64,
    /// Where the estimate puts the peak: `start of backward` or `end of backward`.
    pub peak_phase: &'static str,
    pub measured_bytes: Option<u64>,
    /// (estimate − measured) / measured, in %.
    pub error_pct: Option<f64>,
    pub outcome: Outcome,
    pub steps: StepCounts,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fit {
    pub fixed_bytes: f64,
    pub per_sample_bytes: f64,
    pub points: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProfileReport {
    pub device: String,
    pub method: String,
    pub accumulation: u64,
    pub steps: u64,
    pub capacity_bytes: u64,
    pub budget_bytes: u64,
    pub points: Vec<Point>,
    pub fit: Option<Fit>,
    /// The same least-squares line through the estimates at the measured sizes (so both lines
    /// describe the same regime: end of backward at small sizes, activations at large ones).
    pub estimate_fit: Option<Fit>,
    /// Found by the search (double, then bisect); none when sizes were given or 1 did not fit.
    pub largest_fitting: Option<u64>,
    /// The size to run ([`super::recommend::dividing_size`] of `largest_fitting`), and its accumulation.
    pub micro_batch: Option<u64>,
    pub micro_accumulation: Option<u64>,
}

/// What to measure and against what.
pub struct Plan<'a> {
    pub device: Device,
    /// Explicit sizes; empty: search.
    pub sizes: Vec<u64>,
    pub steps: u64,
    /// Per-GPU batch (bounds the search); none: search up to 1024.
    pub rank_batch: Option<u64>,
    pub margin: f64,
    /// Run each size in a child process even where `clear_refs` works.
    pub isolate: bool,
    /// The estimate compared with: the model and a setup for the device measured on.
    pub model: &'a Transformer,
    pub setup: &'a Setup,
}

/// The memory a profile may use on `device`, and the cap to enforce it with (`None`: no cap).
pub fn capacity(device: Device, asked: Option<u64>) -> Result<u64, ProfileError> {
    match device {
        Device::Cuda(i) => {
            let (_, total) = ffi::memory_info(i)?;
            Ok(asked.map_or(total, |a| a.min(total)))
        }
        // Never more than what the machine has free: past it the kernel's OOM killer would end
        // the process before the allocator could refuse.
        _ => {
            let avail = mem_available().unwrap_or(u64::MAX);
            Ok(asked.map_or(avail, |a| a.min(avail)))
        }
    }
}

fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line["MemAvailable:".len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

/// A model, its optimizer and the corpus, built once; sizes are measured one after another.
pub struct Session {
    trainable: Trainable,
    corpus: Corpus,
    plan: RunPlan,
    baseline: u64,
    used_before: u64,
}

impl Session {
    /// Caps memory at `cap` (the allocator then fails there and the guard reports it), warms
    /// libtorch up, records the baseline, builds the model and its optimizer as training does.
    pub fn open(plan: RunPlan, cap: u64) -> Result<Self, ProfileError> {
        let (config, device) = (&plan.config, plan.device);
        if let Some(n) = config.train.threads {
            tch::set_num_threads(n as i32);
        }
        crate::step::precision::configure_process(config.precision, device);
        let m = &config.model;
        let corpus = Corpus::load(&config.data, m.vocab_size, m.seq_len, config.train.eval_interval > 0)?;
        let eos = crate::model::documents::run_eos(&config.data, corpus.manifest.as_ref().map(|m| m.eos_id))?;
        let limit_now = match device {
            Device::Cuda(i) => ffi::memory_info(i)?.1 > cap,
            _ => true,
        };
        // The allocator settings training would run with (on CUDA the cap is a memory fraction
        // that goes in with them), so that what is measured is what training will reserve.
        let fraction = memory::limit_fraction(limit_now.then_some(cap), device)?;
        let settings = memory::allocator::configure(&config.memory.allocator, fraction, device.is_cuda())
            .map_err(|e| ProfileError::Step(e.to_string()))?;
        tracing::info!("profile: allocator settings `{}` ({})", settings.conf, settings.source);
        if limit_now {
            memory::apply_limit(cap, device)?;
        }
        // One step of a one-block copy of the model before the baseline: what libtorch sets up
        // once per process (kernel code paged in, BLAS buffers, cuBLAS workspaces) then belongs
        // to the baseline, not to the first size measured.
        {
            let mut small = config.model.clone();
            small.n_layer = 1;
            let mut warm = build(&plan, &small, eos).map_err(setup_oom(cap))?;
            if steps(&mut warm, &corpus, &plan, 1, 1)?.is_none() {
                tracing::warn!("profile: the warm-up step (one block, micro-batch 1) ran out of memory");
            }
        }
        memory::empty_cache(device);
        if !device.is_cuda() {
            ffi::os::release_free_heap();
        }
        let (baseline, used_before) = match device {
            Device::Cuda(i) => {
                let (free, total) = ffi::memory_info(i)?;
                (ffi::device_stats(i)?.allocated_current[0].max(0) as u64, total - free)
            }
            _ => (ProcessMemory::read().ok_or(ProfileError::NoProcStatus)?.rss_bytes, 0),
        };
        let trainable = build(&plan, m, eos).map_err(setup_oom(cap))?;
        Ok(Self { trainable, corpus, plan, baseline, used_before })
    }

    /// `steps` guarded optimizer steps at micro-batch `micro` (accumulating [`ACCUMULATION`]).
    pub fn measure(&mut self, micro: u64, n: u64) -> Result<Measured, ProfileError> {
        let device = self.plan.device;
        reset_peak(device)?;
        let retries_before = match device {
            Device::Cuda(i) => ffi::device_stats(i)?.num_alloc_retries,
            _ => 0,
        };
        let Some(steps) = steps(&mut self.trainable, &self.corpus, &self.plan, micro, n)? else {
            return Ok(Measured { oom: true, ..Default::default() });
        };
        match device {
            Device::Cuda(i) => {
                let s = ffi::device_stats(i)?;
                let peak = (s.allocated_peak[0].max(0) as u64).saturating_sub(self.baseline);
                let retries = (s.num_alloc_retries - retries_before).max(0) as u64;
                Ok(Measured {
                    peak: Some(peak),
                    device_used: Some(s.reserved_peak[0].max(0) as u64 + self.used_before),
                    retries,
                    oom: false,
                    steps,
                })
            }
            _ => {
                let p = ProcessMemory::read().ok_or(ProfileError::NoProcStatus)?;
                Ok(Measured {
                    peak: Some(p.rss_peak_bytes.saturating_sub(self.baseline)),
                    device_used: None,
                    retries: 0,
                    oom: false,
                    steps,
                })
            }
        }
    }
}

/// An out-of-memory while the session is set up is the profile's answer, not a libtorch error.
fn setup_oom(cap: u64) -> impl Fn(TchError) -> ProfileError {
    move |e| match crate::guard::classify(&e.to_string()) {
        crate::guard::ErrorKind::OutOfMemory { .. } => ProfileError::SetupOutOfMemory { cap },
        crate::guard::ErrorKind::Other => e.into(),
    }
}

/// The model, optimizer and loss scaler training would build for `plan`, with `model`'s shape.
fn build(
    plan: &RunPlan,
    model: &crate::config::ModelConfig,
    eos: Option<u32>,
) -> Result<Trainable, TchError> {
    let (c, t) = (&plan.config, &plan.config.train);
    let scaler = crate::step::LossScaler::new(t.loss_scale_initial, t.loss_scale_growth_interval);
    let mut built = Trainable::build(
        model,
        c.kernels,
        &plan.optimizer,
        plan.layout,
        c.precision,
        scaler,
        c.seed,
        plan.device,
    )?;
    if let Some(eos) = eos {
        built.model.mask_documents(eos);
    }
    Ok(built)
}

/// `n` of training's optimizer steps at micro-batch `micro`, each inside the guard with
/// `oom.policy: fail`. `None`: out of memory (caught, everything freed).
fn steps(
    t: &mut Trainable,
    corpus: &Corpus,
    plan: &RunPlan,
    micro: u64,
    n: u64,
) -> Result<Option<StepCounts>, ProfileError> {
    let (config, device) = (&plan.config, plan.device);
    let rank_batch = (micro * ACCUMULATION) as usize;
    let data = StepData::single(
        corpus,
        Sampler { seed: config.seed, seq_len: config.model.seq_len },
        device,
        rank_batch,
    );
    let mut guard =
        Guard::new(GuardState::new(micro as usize, micro as usize, 0), OomPolicy::Fail, device, rank_batch);
    let mut reporter = Reporter::new(None, 1, n, None).map_err(|e| ProfileError::Step(e.to_string()))?;
    let mut faults = Faults::new(&config.faults, 0, 0);
    let mut counts = StepCounts::default();
    for step in 0..n {
        match optimizer_step(
            t,
            &mut guard,
            &plan.step,
            &data,
            step,
            config.train.lr,
            None,
            &mut faults,
            &mut reporter,
        ) {
            Ok(o) if o.applied => counts.applied += 1,
            Ok(_) => counts.skipped += 1,
            Err(GuardError::OutOfMemory(_)) => return Ok(None),
            Err(GuardError::Torch { error, .. }) => return Err(error.into()),
            Err(e) => return Err(ProfileError::Step(e.to_string())),
        }
    }
    counts.loss_scale = t.scaler.as_ref().map(|s| s.scale);
    Ok(Some(counts))
}

/// Starts a new peak: the allocator's peak counters on CUDA, VmHWM on CPU.
fn reset_peak(device: Device) -> Result<(), ProfileError> {
    match device {
        Device::Cuda(i) => {
            memory::empty_cache(device);
            Ok(ffi::reset_peak_stats(i)?)
        }
        _ => std::fs::write("/proc/self/clear_refs", "5").map_err(ProfileError::ResetPeak),
    }
}

/// Whether this process can reset its peak resident size (else sizes run in child processes).
pub fn can_reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Least squares `y = fixed + slope · x`; none with fewer than two distinct sizes.
pub fn fit_line(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    let (sx, sy) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| (a + x, b + y));
    let (mx, my) = (sx / n, sy / n);
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx).powi(2)).sum();
    if points.len() < 2 || sxx == 0.0 {
        return None;
    }
    let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let slope = sxy / sxx;
    Some((my - slope * mx, slope))
}

/// Runs the profile. `measure_one(b)` is either an in-process [`Session`] or a child process;
/// the caller picks (see `planner::run_profile`).
pub fn run(
    plan: &Plan,
    capacity: u64,
    mut measure_one: impl FnMut(u64) -> Result<Measured, ProfileError>,
) -> Result<ProfileReport, ProfileError> {
    let budget = (capacity as f64 * plan.margin).floor() as u64;
    let est = |b: u64| estimate(plan.model, plan.setup, b, ACCUMULATION);
    let mut points: Vec<Point> = Vec::new();
    let mut failure: Option<ProfileError> = None;
    let mut record = |b: u64, points: &mut Vec<Point>| -> bool {
        if failure.is_some() {
            return false;
        }
        if let Some(p) = points.iter().find(|p| p.micro_batch == b) {
            return p.outcome == Outcome::Fits;
        }
        tracing::info!("profile: micro-batch {b} ({} steps of {ACCUMULATION} micro-steps)", plan.steps);
        let m = match measure_one(b) {
            Ok(m) => m,
            Err(e) => {
                failure = Some(e);
                return false;
            }
        };
        let e = est(b);
        let (estimate_bytes, peak_phase) = (e.peak_allocated, e.peak_phase);
        let outcome = match (m.oom, m.device_used.or(m.peak)) {
            (true, _) | (false, None) => Outcome::OutOfMemory,
            (false, Some(used)) if used > budget => Outcome::OverBudget,
            _ if m.retries > 0 => Outcome::Retries,
            _ => Outcome::Fits,
        };
        let error_pct =
            m.peak.filter(|&p| p > 0).map(|p| (estimate_bytes as f64 - p as f64) / p as f64 * 100.0);
        points.push(Point {
            micro_batch: b,
            estimate_bytes,
            peak_phase,
            measured_bytes: m.peak,
            error_pct,
            outcome,
            steps: m.steps,
        });
        outcome == Outcome::Fits
    };
    let largest = if plan.sizes.is_empty() {
        largest_fitting(plan.rank_batch.unwrap_or(1024), |b| record(b, &mut points))
    } else {
        for &b in &plan.sizes {
            record(b, &mut points);
        }
        None
    };
    if let Some(e) = failure {
        return Err(e);
    }
    points.sort_by_key(|p| p.micro_batch);
    let measured: Vec<&Point> = points.iter().filter(|p| p.measured_bytes.is_some()).collect();
    let line = |y: &dyn Fn(&Point) -> u64| {
        let xy: Vec<(f64, f64)> = measured.iter().map(|p| (p.micro_batch as f64, y(p) as f64)).collect();
        fit_line(&xy).map(|(fixed, slope)| Fit {
            fixed_bytes: fixed,
            per_sample_bytes: slope,
            points: xy.len(),
        })
    };
    let fit = line(&|p| p.measured_bytes.unwrap_or_default());
    let estimate_fit = line(&|p| p.estimate_bytes);
    // Any size works (the last micro-batch of a step takes the remainder); one that divides the
    // batch in as many micro-steps is preferred.
    let micro_batch = largest.map(|b| plan.rank_batch.map_or(b, |r| super::recommend::dividing_size(r, b)));
    Ok(ProfileReport {
        device: format!("{:?}", plan.device).to_lowercase(),
        method: String::new(),
        accumulation: ACCUMULATION,
        steps: plan.steps,
        capacity_bytes: capacity,
        budget_bytes: budget,
        points,
        fit,
        estimate_fit,
        largest_fitting: largest,
        micro_batch,
        micro_accumulation: micro_batch.and_then(|b| plan.rank_batch.map(|r| r.div_ceil(b))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_squares_recovers_a_line_and_needs_two_sizes() {
        let pts: Vec<(f64, f64)> = [1.0, 2.0, 4.0, 8.0].iter().map(|&x| (x, 100.0 + 25.0 * x)).collect();
        let (a, b) = fit_line(&pts).unwrap();
        assert!((a - 100.0).abs() < 1e-9 && (b - 25.0).abs() < 1e-9, "{a} {b}");
        assert!(fit_line(&[(2.0, 1.0)]).is_none());
        assert!(fit_line(&[(2.0, 1.0), (2.0, 3.0)]).is_none());
        // Noise: the slope of y = 10 + 3x ± 1 stays near 3.
        let noisy = [(1.0, 14.0), (2.0, 15.0), (3.0, 20.0), (4.0, 21.0)];
        let (_, s) = fit_line(&noisy).unwrap();
        assert!((s - 2.6).abs() < 1e-9, "{s}");
    }

    fn plan_parts() -> (Transformer, Setup) {
        let model = Transformer::from_config(&crate::config::Config::default().model);
        let setup = super::super::estimate::fixtures::cpu_fp32_adamw();
        (model, setup)
    }

    /// A device where a step at micro-batch b peaks at 100 + 10·b bytes and b ≥ 45 runs out of memory.
    fn fake(b: u64) -> Result<Measured, ProfileError> {
        Ok(if b >= 45 {
            Measured { oom: true, ..Default::default() }
        } else {
            Measured { peak: Some(100 + 10 * b), ..Default::default() }
        })
    }

    #[test]
    fn the_search_doubles_then_bisects_on_measurements_within_the_margin() {
        let (model, setup) = plan_parts();
        let plan = Plan {
            device: Device::Cpu,
            sizes: vec![],
            steps: 1,
            rank_batch: Some(48),
            margin: 0.5,
            isolate: false,
            model: &model,
            setup: &setup,
        };
        let mut seen = Vec::new();
        // Capacity 1000 at margin 0.5: a budget of 500 bytes, so 40 is the largest that fits.
        let r = run(&plan, 1000, |b| {
            seen.push(b);
            fake(b)
        })
        .unwrap();
        assert_eq!(
            seen,
            [1, 2, 4, 8, 16, 32, 48, 40, 44, 42, 41],
            "doubling (capped at the per-GPU batch), then bisection"
        );
        assert_eq!(r.largest_fitting, Some(40));
        assert_eq!(
            (r.micro_batch, r.micro_accumulation),
            (Some(24), Some(2)),
            "40 fits, and 24 × 2 takes as many micro-steps as 40 + 8"
        );
        let outcome = |b: u64| r.points.iter().find(|p| p.micro_batch == b).unwrap().outcome;
        assert_eq!(
            (outcome(40), outcome(41), outcome(48)),
            (Outcome::Fits, Outcome::OverBudget, Outcome::OutOfMemory)
        );
        let fit = r.fit.unwrap();
        assert!(
            (fit.fixed_bytes - 100.0).abs() < 1e-6 && (fit.per_sample_bytes - 10.0).abs() < 1e-6,
            "{fit:?}"
        );
        assert_eq!(fit.points, 10, "every size that ran, over budget or not; not the one out of memory");
        assert!(r.points.windows(2).all(|w| w[0].micro_batch < w[1].micro_batch));
    }

    /// A size whose steps made the CUDA allocator retry does not fit, however far below the
    /// budget its reserved peak is: the search settles below it.
    #[test]
    fn a_size_that_made_the_allocator_retry_does_not_fit() {
        let (model, setup) = plan_parts();
        let plan = Plan {
            device: Device::Cpu,
            sizes: vec![],
            steps: 1,
            rank_batch: Some(48),
            margin: 0.5,
            isolate: false,
            model: &model,
            setup: &setup,
        };
        let r = run(&plan, 1000, |b| fake(b).map(|m| Measured { retries: u64::from(b >= 30), ..m })).unwrap();
        assert_eq!(r.largest_fitting, Some(29));
        let outcome = |b: u64| r.points.iter().find(|p| p.micro_batch == b).unwrap().outcome;
        assert_eq!(
            (outcome(29), outcome(30), outcome(32)),
            (Outcome::Fits, Outcome::Retries, Outcome::Retries)
        );
    }

    #[test]
    fn explicit_sizes_are_measured_as_given_and_failures_propagate() {
        let (model, setup) = plan_parts();
        let plan = Plan {
            device: Device::Cpu,
            sizes: vec![4, 1, 2],
            steps: 1,
            rank_batch: None,
            margin: 0.85,
            isolate: false,
            model: &model,
            setup: &setup,
        };
        let r = run(&plan, 1 << 30, fake).unwrap();
        assert_eq!(r.points.iter().map(|p| p.micro_batch).collect::<Vec<_>>(), [1, 2, 4]);
        assert_eq!(r.largest_fitting, None, "no search");
        let p = &r.points[0];
        let want = (p.estimate_bytes as f64 - 110.0) / 110.0 * 100.0;
        assert!((p.error_pct.unwrap() - want).abs() < 1e-9);
        let err = run(&plan, 1 << 30, |b| if b == 2 { Err(ProfileError::NoProcStatus) } else { fake(b) });
        assert!(matches!(err, Err(ProfileError::NoProcStatus)));
    }

    #[test]
    fn the_peak_resident_size_can_be_reset_here() {
        // Documents the machine: where this fails, the profile uses child processes.
        if !can_reset_peak() {
            eprintln!("skipped: /proc/self/clear_refs is not writable here; --profile uses child processes");
            return;
        }
        // Tests in this process run on other threads and allocate and free as they go, which can
        // hide 64 MiB in the resident size for a moment; the check is retried, so it fails only
        // where the peak is never raised by the allocation or never brought back by the reset.
        let mut last = String::new();
        for _ in 0..8 {
            let before = ProcessMemory::read().unwrap();
            let v = vec![1u8; 64 << 20];
            std::hint::black_box(&v);
            drop(v);
            let raised = ProcessMemory::read().unwrap();
            assert!(can_reset_peak());
            let after = ProcessMemory::read().unwrap();
            let peak_raised = raised.rss_peak_bytes >= before.rss_bytes + (60 << 20);
            let peak_reset = after.rss_peak_bytes < after.rss_bytes + (32 << 20);
            if peak_raised && peak_reset {
                return;
            }
            last = format!("before {before:?}, after the allocation {raised:?}, after the reset {after:?}");
        }
        panic!("VmHWM should rise by the 64 MiB allocation and fall back to VmRSS when reset: {last}");
    }
}
