//! The trace reader: a Chrome trace (ours, or one `torch.profiler` wrote) parsed into events
//! with durations, and [`summarise`]d: where the time went by kind of work ([`Work`]) and by the
//! heaviest kernels; `trainguard trace`'s tables. Pure functions of the file's events,
//! unit-tested.
use super::TraceError;
use serde::Serialize;
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

/// One event with a duration: an operator or range the CPU ran (`lane`: its thread), with
/// `launch` a CUDA runtime call the CPU made (a kernel's launch), or with `device_side` a kernel,
/// copy or set the GPU ran (`lane`: its stream). A launch and what it launched share a
/// `correlation` id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEvent {
    pub device_side: bool,
    pub launch: bool,
    pub correlation: Option<u64>,
    pub lane: u64,
    pub start_ns: u64,
    pub end_ns: u64,
    pub name: String,
}

impl TraceEvent {
    /// An operator or range the CPU ran (not a runtime call, not the GPU's).
    fn is_cpu_op(&self) -> bool {
        !self.device_side && !self.launch
    }

    /// One of the ranges that mark steps (they are not work).
    fn is_step_range(&self) -> bool {
        STEP_RANGES.iter().any(|p| self.name.starts_with(p))
    }
}

/// `events` by lane, each lane's outer events first (earlier start, then later end): the order in
/// which one sweep with a stack of open events sees each event after those around it.
fn lanes_outer_first<'a>(
    events: impl IntoIterator<Item = &'a TraceEvent>,
) -> HashMap<u64, Vec<&'a TraceEvent>> {
    let mut by_lane: HashMap<u64, Vec<&TraceEvent>> = HashMap::new();
    for e in events {
        by_lane.entry(e.lane).or_default().push(e);
    }
    for lane in by_lane.values_mut() {
        lane.sort_by(|a, b| a.start_ns.cmp(&b.start_ns).then(b.end_ns.cmp(&a.end_ns)));
    }
    by_lane
}

/// The name of our step ranges, before the step's number (`trainguard step N`).
pub(super) const OUR_STEP_RANGE: &str = "trainguard step ";

/// The step ranges a trace marks: ours or `torch.profiler`'s (`ProfilerStep#N`).
const STEP_RANGES: [&str; 2] = [OUR_STEP_RANGE, "ProfilerStep#"];

/// What [`parse`] read from a trace: the events it counts, and why any complete event of a kind
/// it reads could not be counted.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub events: Vec<TraceEvent>,
    pub skipped: Vec<Skipped>,
}

/// Complete events of a kind the summary counts that it left out, for one reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// What was wrong with them: `` `dur` missing ``, `` `ts` null ``, `` `dur` negative ``…
    pub why: String,
    pub events: u64,
}

/// `skipped` in words: `2 with `dur` missing, 1 with `ts` null`.
fn skipped_in_words(skipped: &[Skipped]) -> String {
    skipped.iter().map(|s| format!("{} with {}", s.events, s.why)).collect::<Vec<_>>().join(", ")
}

/// How many events `skipped` counts, said: `3 events`.
fn skipped_events(skipped: &[Skipped]) -> String {
    n_events(skipped.iter().map(|s| s.events).sum())
}

/// `n events`, `1 event`.
fn n_events(n: u64) -> String {
    format!("{n} {}", if n == 1 { "event" } else { "events" })
}

/// An event's time field in microseconds, or what is wrong with it (serde_json's numbers are
/// finite: JSON has no NaN, and it refuses a number out of f64's range).
fn micros(event: &Value, key: &str) -> Result<f64, String> {
    match event.get(key) {
        None => Err(format!("`{key}` missing")),
        Some(Value::Null) => Err(format!("`{key}` null")),
        Some(v) => match v.as_f64() {
            None => Err(format!("`{key}` not a number")),
            Some(x) if x < 0.0 => Err(format!("`{key}` negative")),
            Some(x) => Ok(x),
        },
    }
}

/// The events of a Chrome trace as Kineto writes it: complete events (`"ph": "X"`) with `ts`
/// and `dur` in microseconds; `cat` `kernel`, `gpu_memcpy` and `gpu_memset` are the GPU's,
/// `cpu_op` and `user_annotation` the CPU's, `cuda_runtime` and `cuda_driver` the launches (the
/// rest, such as Python functions, are left out). `args.correlation` ties a launch to what it
/// launched. The trace is the Trace Event Format's object (`{"traceEvents": [...]}`) or its
/// JSON Array Format (the list of events alone), which chrome://tracing and Perfetto open too.
///
/// Times become nanoseconds from the earliest event's start: a trace's own clock (Kineto's is
/// microseconds since boot, others' since the epoch, some nanoseconds written as microseconds)
/// can pass `u64` nanoseconds, and durations taken between such numbers overflowed to nothing.
/// An event whose `ts` or `dur` cannot be used is left out and counted in [`Parsed::skipped`].
pub fn parse(trace: &Value) -> Result<Parsed, String> {
    let list = event_list(trace)?;
    // The events read, with `ts` and `dur` in microseconds as written.
    let mut read: Vec<(TraceEvent, f64, f64)> = Vec::new();
    let mut skipped: HashMap<String, u64> = HashMap::new();
    for e in list {
        if e.get("ph").and_then(Value::as_str) != Some("X") {
            continue;
        }
        let (device_side, launch) = match e.get("cat").and_then(Value::as_str) {
            Some("kernel" | "gpu_memcpy" | "gpu_memset") => (true, false),
            Some("cpu_op" | "user_annotation") => (false, false),
            Some("cuda_runtime" | "cuda_driver") => (false, true),
            _ => continue,
        };
        let name =
            e.get("name").and_then(Value::as_str).ok_or_else(|| "`name` missing or not text".to_string());
        let (ts, dur, name) = match (micros(e, "ts"), micros(e, "dur"), name) {
            (Ok(ts), Ok(dur), Ok(name)) => (ts, dur, name),
            // One reason per event (the first), so that the reasons' counts add up.
            (Err(why), _, _) | (_, Err(why), _) | (_, _, Err(why)) => {
                *skipped.entry(why).or_default() += 1;
                continue;
            }
        };
        let correlation = e.get("args").and_then(|a| a.get("correlation")).and_then(Value::as_u64);
        let lane = e
            .get("tid")
            .and_then(|t| {
                t.as_u64().or_else(|| t.as_str().and_then(|s| s.trim_start_matches("stream ").parse().ok()))
            })
            .unwrap_or(0);
        read.push((
            TraceEvent {
                device_side,
                launch,
                correlation,
                lane,
                start_ns: 0,
                end_ns: 0,
                name: name.to_string(),
            },
            ts,
            dur,
        ));
    }
    // Rounded to whole nanoseconds before the earliest start is taken off: below 2^53 ns
    // (104 days) both are exact in f64, so Kineto's clock gives the nanoseconds it wrote.
    let ns = |us: f64| (us * 1000.0).round();
    let first = read.iter().map(|(_, ts, _)| ns(*ts)).fold(f64::INFINITY, f64::min);
    let mut events = Vec::with_capacity(read.len());
    for (mut e, ts, dur) in read {
        let (start, dur) = (ns(ts) - first, ns(dur));
        // An end past u64 nanoseconds (584 years after the first event) is left out: `as`
        // would saturate, and the sum overflow.
        let fits = start + dur < u64::MAX as f64;
        let Some(end) = (start as u64).checked_add(dur as u64).filter(|_| fits) else {
            *skipped.entry("`ts` + `dur` past 584 years after the first event".into()).or_default() += 1;
            continue;
        };
        (e.start_ns, e.end_ns) = (start as u64, end);
        events.push(e);
    }
    let mut skipped: Vec<Skipped> =
        skipped.into_iter().map(|(why, events)| Skipped { why, events }).collect();
    skipped.sort_by(|a, b| b.events.cmp(&a.events).then_with(|| a.why.cmp(&b.why)));
    Ok(Parsed { events, skipped })
}

/// A trace's events: the object's `traceEvents`, or the JSON Array Format's list itself.
fn event_list(trace: &Value) -> Result<&Vec<Value>, String> {
    match trace {
        Value::Array(list) => Ok(list),
        _ => trace.get("traceEvents").and_then(Value::as_array).ok_or_else(|| {
            "no `traceEvents` list, and not a list of events (the JSON Array Format): not a Chrome trace"
                .into()
        }),
    }
}

/// The first bytes of a gzip stream (RFC 1952): `torch.profiler`'s
/// `tensorboard_trace_handler(use_gzip=True)` writes its traces so (`*.pt.trace.json.gz`).
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// The summary of the Chrome trace at `path`, naming its `top` heaviest kernels (operators) and
/// launching operators.
pub fn read(path: &Path, top: usize) -> Result<TraceSummary, TraceError> {
    let bytes = crate::fs::whole_file::read_regular(path)
        .map_err(|error| TraceError::Read { path: path.to_path_buf(), error })?;
    summary_of(&bytes, path, top)
}

/// The summary of a trace's bytes, read from `path`.
fn summary_of(bytes: &[u8], path: &Path, top: usize) -> Result<TraceSummary, TraceError> {
    // No gzip decoder among our dependencies: said plainly, rather than as the JSON reader's
    // complaint about the compressed bytes.
    if bytes.starts_with(&GZIP_MAGIC) {
        // gunzip's own name for what it writes, or one beside the file (it refuses other suffixes).
        let unzipped = match path.extension() {
            Some(gz) if gz == "gz" => path.with_extension(""),
            _ => path.with_extension("json"),
        };
        return Err(TraceError::Gzip { path: path.to_path_buf(), unzipped });
    }
    let bad = |message: String| TraceError::Format { path: path.to_path_buf(), message };
    let value: Value = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
    let Parsed { events, skipped } = parse(&value).map_err(bad)?;
    // Launches and step ranges are not work: a trace of nothing else would tabulate zeros.
    if !events.iter().any(|e| !e.launch && !e.is_step_range()) {
        let listed = event_list(&value).map_or(0, Vec::len) as u64;
        let mut why = if listed == 0 {
            "its event list is empty".to_string()
        } else {
            format!("of its {}, none is a kernel, copy or set the GPU ran or an operator the CPU ran (a complete event, `\"ph\": \"X\"`, of `cat` kernel, gpu_memcpy, gpu_memset, cpu_op or user_annotation, other than the step ranges)", n_events(listed))
        };
        if !skipped.is_empty() {
            why +=
                &format!("; {} could not be read: {}", skipped_events(&skipped), skipped_in_words(&skipped));
        }
        return Err(TraceError::Empty { path: path.to_path_buf(), why });
    }
    let mut summary = summarise(&events, path, top);
    summary.skipped = skipped;
    Ok(summary)
}

/// The kind of work an operator or kernel does, read from its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Work {
    /// Matrix multiplications (cuBLAS, CUTLASS, `aten::mm`…).
    Gemm,
    /// Fused attention kernels (flash, memory-efficient) and SDPA.
    Attention,
    /// LayerNorm and RMSNorm, forward and backward.
    Norm,
    /// Softmax, log-softmax, NLL and our fused cross-entropy.
    Loss,
    /// Optimizer updates and clipping's norms.
    Optimizer,
    /// Embedding lookups and their backward.
    Embedding,
    /// Copies, casts, fills and concatenations.
    Copy,
    /// Reductions (sums, means, bias gradients).
    Reduce,
    /// Other elementwise kernels (adds, GELU, dropout…).
    Elementwise,
    Other,
}

impl Work {
    pub const ALL: [Work; 10] = [
        Work::Gemm,
        Work::Attention,
        Work::Norm,
        Work::Loss,
        Work::Optimizer,
        Work::Embedding,
        Work::Copy,
        Work::Reduce,
        Work::Elementwise,
        Work::Other,
    ];

    /// The name the tables and JSON use.
    pub fn name(self) -> &'static str {
        match self {
            Work::Gemm => "gemm",
            Work::Attention => "attention",
            Work::Norm => "norm",
            Work::Loss => "loss",
            Work::Optimizer => "optimizer",
            Work::Embedding => "embedding",
            Work::Copy => "copy",
            Work::Reduce => "reduce",
            Work::Elementwise => "elementwise",
            Work::Other => "other",
        }
    }
}

/// What `name` (a CUDA kernel's or an ATen operator's) does. The first rule that matches wins,
/// so a kernel that is both (a CUTLASS attention kernel, an elementwise copy) gets the more
/// specific kind.
pub fn work_of(name: &str) -> Work {
    let n = name.to_ascii_lowercase();
    let any = |keys: &[&str]| keys.iter().any(|k| n.contains(k));
    if any(&["flash", "fmha", "attention", "sdpa", "cudnn::fusion"]) {
        Work::Attention
    } else if any(&["tg_ce_", "cross_entropy", "softmax", "nll_loss", "logsumexp"]) {
        Work::Loss
    } else if any(&["adam", "adafactor", "sgd", "multi_tensor_apply", "_foreach", "lpnorm", "tg_global_norm"])
    {
        Work::Optimizer
    } else if any(&["layer_norm", "layernorm", "rms_norm", "rmsnorm", "gammabeta", "cucomputegrad", "tg_ln_"])
    {
        Work::Norm
    } else if any(&[
        "gemm",
        "gemv",
        "nvjet",
        "xmma",
        "cutlass",
        "cublas",
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::matmul",
        "splitkreduce",
    ]) {
        Work::Gemm
    } else if any(&["embedding", "indexselect", "index_select"]) {
        Work::Embedding
    } else if any(&["copy", "memcpy", "memset", "fill", "aten::cat", "aten::clone", "aten::contiguous"])
        || n == "aten::to"
    {
        Work::Copy
    } else if any(&[
        "reduce_kernel",
        "aten::sum",
        "aten::mean",
        "aten::norm",
        "aten::max",
        "aten::min",
        "tg_col_sum",
    ]) {
        Work::Reduce
    } else if any(&[
        "elementwise",
        "aten::add",
        "aten::mul",
        "aten::sub",
        "aten::div",
        "gelu",
        "silu",
        "dropout",
        "aten::where",
        "aten::exp",
        "aten::neg",
        "aten::rsqrt",
        "aten::pow",
        "tg_swiglu",
        "tg_rope",
    ]) {
        Work::Elementwise
    } else {
        Work::Other
    }
}

/// Time spent on one kind of work.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkTime {
    pub work: Work,
    pub ms: f64,
    /// Of all the time counted.
    pub share: f64,
    pub calls: u64,
}

/// Time spent in one kernel or operator (all calls).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NameTime {
    pub name: String,
    pub work: Work,
    pub ms: f64,
    pub calls: u64,
}

/// Where the traced steps' time went.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceSummary {
    /// The Chrome trace.
    pub path: String,
    /// The first step's number and how many distinct steps the trace marks (1 when it marks
    /// none: the figures are then the whole trace's). A step whose range appears twice counts
    /// once: the per-step figures divide by the steps, not by the ranges.
    pub first_step: Option<u64>,
    pub steps: u64,
    /// The distinct step numbers marked, ascending (they need not be contiguous).
    pub step_numbers: Vec<u64>,
    /// `gpu kernels` (their durations) or `cpu operators` (their self times).
    pub counted: String,
    /// The time counted, over all traced steps.
    pub busy_ms: f64,
    /// From the first event's start to the last one's end.
    pub span_ms: f64,
    /// Heaviest first.
    pub by_work: Vec<WorkTime>,
    /// The heaviest names.
    pub top: Vec<NameTime>,
    /// GPU time by the CPU operator that launched it, heaviest first (none without GPU events).
    pub by_operator: Vec<OperatorTime>,
    /// Complete events of the kinds counted that the figures leave out, and why (a `dur`
    /// missing…), most first.
    pub skipped: Vec<Skipped>,
}

impl TraceSummary {
    /// The warning to give when the figures leave events out (`None` when they leave none).
    pub fn skipped_warning(&self) -> Option<String> {
        (!self.skipped.is_empty()).then(|| {
            format!(
                "{}: the figures leave out {} they could not read: {}",
                self.path,
                skipped_events(&self.skipped),
                skipped_in_words(&self.skipped)
            )
        })
    }
}

/// GPU time launched by one CPU operator: `outer › inner` (the outermost operator around the
/// launch, and the innermost: `aten::linear › aten::addmm`, or in backward
/// `autograd::engine::evaluate_function: AddmmBackward0 › aten::sum`), or one name where they
/// are the same.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OperatorTime {
    pub operator: String,
    pub ms: f64,
    /// Kernels, copies and sets it launched.
    pub kernels: u64,
}

/// What the GPU time of a kernel no operator encloses (or whose launch the trace lacks) is filed under.
pub const NO_OPERATOR: &str = "(no operator)";

/// How many names [`TraceSummary::top`] keeps in a run's `trace_written` event and by default
/// in `trainguard trace`.
pub const TOP: usize = 12;

/// Durations per name: the GPU's events when there are any (kernels do not nest), else the CPU
/// operators' self times (`cpu_self_times`).
fn counted_times(events: &[&TraceEvent]) -> (String, Vec<(String, u64)>) {
    let device: Vec<&TraceEvent> = events.iter().copied().filter(|e| e.device_side).collect();
    if device.is_empty() {
        ("cpu operators".into(), cpu_self_times(events.iter().copied()))
    } else {
        (
            "gpu kernels".into(),
            device.iter().map(|e| (e.name.clone(), e.end_ns.saturating_sub(e.start_ns))).collect(),
        )
    }
}

/// Each CPU event's own time: its duration less that of the events nested directly inside it on
/// the same thread (an operator calls others: `aten::linear` → `aten::addmm`).
pub fn cpu_self_times<'a>(events: impl IntoIterator<Item = &'a TraceEvent>) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for lane in lanes_outer_first(events.into_iter().filter(|e| e.is_cpu_op())).into_values() {
        // The open events: index into `out` and end time.
        let mut open: Vec<(usize, u64)> = Vec::new();
        for e in lane {
            while open.last().is_some_and(|&(_, end)| end <= e.start_ns) {
                open.pop();
            }
            let d = e.end_ns.saturating_sub(e.start_ns);
            if let Some(&(parent, end)) = open.last() {
                // Nested (an event overlapping its parent's end is cut at it).
                let inside = d.min(end.saturating_sub(e.start_ns));
                let p: &mut (String, u64) = &mut out[parent];
                p.1 = p.1.saturating_sub(inside);
            }
            out.push((e.name.clone(), d));
            open.push((out.len() - 1, e.end_ns));
        }
    }
    out
}

/// The summary of `events`, read from `path`.
pub fn summarise(events: &[TraceEvent], path: &Path, keep: usize) -> TraceSummary {
    let marked: BTreeSet<u64> = events
        .iter()
        .filter(|e| e.is_cpu_op())
        .filter_map(|e| {
            STEP_RANGES.iter().find_map(|p| e.name.strip_prefix(p)).and_then(|n| n.trim().parse().ok())
        })
        .collect();
    let step_numbers: Vec<u64> = marked.into_iter().collect();
    let (first_step, steps) = (step_numbers.first().copied(), (step_numbers.len() as u64).max(1));
    // The step ranges mark steps; they are not work.
    let work_events: Vec<&TraceEvent> = events.iter().filter(|e| !e.launch && !e.is_step_range()).collect();
    let (counted, times) = counted_times(&work_events);
    // Sums saturate: a trace's durations are its file's, and a few absurd ones must not wrap
    // the total round to a small number.
    let busy: u64 = times.iter().fold(0, |sum, (_, d)| sum.saturating_add(*d));
    let mut per_name: HashMap<&str, (u64, u64)> = HashMap::new();
    for (name, d) in &times {
        let n = per_name.entry(name.as_str()).or_default();
        n.0 = n.0.saturating_add(*d);
        n.1 += 1;
    }
    // Each name's kind read once; a kind's totals are its names' sums.
    let named: Vec<(&str, Work, u64, u64)> =
        per_name.into_iter().map(|(name, (d, calls))| (name, work_of(name), d, calls)).collect();
    let mut per_work: HashMap<Work, (u64, u64)> = HashMap::new();
    for &(_, work, d, calls) in &named {
        let w = per_work.entry(work).or_default();
        w.0 = w.0.saturating_add(d);
        w.1 += calls;
    }
    let ms = |ns: u64| ns as f64 / 1e6;
    let mut by_work: Vec<WorkTime> = per_work
        .into_iter()
        .map(|(work, (d, calls))| WorkTime {
            work,
            ms: ms(d),
            share: if busy > 0 { d as f64 / busy as f64 } else { 0.0 },
            calls,
        })
        .collect();
    by_work.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    let mut top: Vec<NameTime> = named
        .into_iter()
        .map(|(name, work, d, calls)| NameTime { name: name.to_string(), work, ms: ms(d), calls })
        .collect();
    top.sort_by(|a, b| b.ms.total_cmp(&a.ms).then_with(|| a.name.cmp(&b.name)));
    top.truncate(keep);
    let start = events.iter().map(|e| e.start_ns).min().unwrap_or(0);
    let end = events.iter().map(|e| e.end_ns).max().unwrap_or(0);
    let mut by_operator = by_operator(events);
    by_operator.truncate(keep);
    TraceSummary {
        path: path.display().to_string(),
        first_step,
        steps,
        step_numbers,
        counted,
        busy_ms: ms(busy),
        span_ms: ms(end.saturating_sub(start)),
        by_work,
        top,
        by_operator,
        skipped: Vec::new(),
    }
}

/// The GPU's time by the CPU operator that launched it: each GPU event's launch found by its
/// correlation id, the operators open on the launch's thread at that moment found by one sweep
/// per thread (operators nest). Heaviest first.
pub fn by_operator(events: &[TraceEvent]) -> Vec<OperatorTime> {
    let mut ops_by_lane = lanes_outer_first(events.iter().filter(|e| e.is_cpu_op() && !e.is_step_range()));
    let launches_by_lane = lanes_outer_first(events.iter().filter(|e| e.launch && e.correlation.is_some()));
    let mut launched_by: HashMap<u64, String> = HashMap::new();
    for (lane, launches) in launches_by_lane {
        let ops = ops_by_lane.remove(&lane).unwrap_or_default();
        let (mut next, mut open): (usize, Vec<&TraceEvent>) = (0, Vec::new());
        for l in launches {
            while next < ops.len() && ops[next].start_ns <= l.start_ns {
                let op = ops[next];
                open.retain(|o| o.end_ns > op.start_ns);
                open.push(op);
                next += 1;
            }
            open.retain(|o| o.end_ns > l.start_ns);
            let name = match (open.first(), open.last()) {
                (Some(outer), Some(inner)) if outer.name != inner.name => {
                    format!("{} › {}", outer.name, inner.name)
                }
                (Some(only), _) => only.name.clone(),
                _ => NO_OPERATOR.to_string(),
            };
            launched_by.insert(l.correlation.unwrap_or_default(), name);
        }
    }
    let mut per_op: HashMap<&str, (u64, u64)> = HashMap::new();
    for e in events.iter().filter(|e| e.device_side) {
        let op = e.correlation.and_then(|c| launched_by.get(&c)).map_or(NO_OPERATOR, String::as_str);
        let t = per_op.entry(op).or_default();
        t.0 = t.0.saturating_add(e.end_ns.saturating_sub(e.start_ns));
        t.1 += 1;
    }
    let mut out: Vec<OperatorTime> = per_op
        .into_iter()
        .map(|(op, (d, n))| OperatorTime { operator: op.to_string(), ms: d as f64 / 1e6, kernels: n })
        .collect();
    out.sort_by(|a, b| b.ms.total_cmp(&a.ms).then_with(|| a.operator.cmp(&b.operator)));
    out
}

/// `s` as Markdown: a heading line, then the time per step by kind of work and by name.
pub fn table(s: &TraceSummary) -> String {
    let per = |ms: f64| ms / s.steps as f64;
    let steps = steps_label(&s.step_numbers);
    let mut out = format!(
        "{}: {steps}, {} {:.2} ms per step ({:.2} ms per step from the first event to the last)\n\n",
        s.path,
        s.counted,
        per(s.busy_ms),
        per(s.span_ms)
    );
    out += "| work | ms per step | share | calls per step |\n|---|---|---|---|\n";
    for w in &s.by_work {
        out += &format!(
            "| {} | {:.2} | {:.1}% | {:.0} |\n",
            w.work.name(),
            per(w.ms),
            100.0 * w.share,
            w.calls as f64 / s.steps as f64
        );
    }
    out += "\n| heaviest | work | ms per step | calls per step |\n|---|---|---|---|\n";
    for n in &s.top {
        let name: String = n.name.chars().take(110).collect::<String>().replace('|', "\\|");
        out += &format!(
            "| `{name}` | {} | {:.2} | {:.0} |\n",
            n.work.name(),
            per(n.ms),
            n.calls as f64 / s.steps as f64
        );
    }
    if !s.by_operator.is_empty() {
        out += "\n| launched by | ms per step | kernels per step |\n|---|---|---|\n";
        for o in &s.by_operator {
            out += &format!(
                "| `{}` | {:.2} | {:.0} |\n",
                o.operator.replace('|', "\\|"),
                per(o.ms),
                o.kernels as f64 / s.steps as f64
            );
        }
    }
    out
}

/// The steps a table's figures are per: `step 3`, `steps 3-4` (the last step itself, as the
/// file's name `steps_3-4.json` says), or for steps with gaps each run of them and how many
/// (`steps 1-2, 5 (3 steps, not contiguous)`): a range would claim steps the trace lacks.
fn steps_label(numbers: &[u64]) -> String {
    let (Some(&first), Some(&last)) = (numbers.first(), numbers.last()) else {
        return "the whole trace (no step ranges)".into();
    };
    if numbers.len() == 1 {
        return format!("step {first}");
    }
    if last - first + 1 == numbers.len() as u64 {
        return format!("steps {first}-{last}");
    }
    // Runs of consecutive numbers (`numbers` is ascending and distinct).
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &n in numbers {
        match runs.last_mut() {
            Some(run) if run.1 + 1 == n => run.1 = n,
            _ => runs.push((n, n)),
        }
    }
    let runs: Vec<String> =
        runs.into_iter().map(|(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") }).collect();
    format!("steps {} ({} steps, not contiguous)", runs.join(", "), numbers.len())
}

/// Several summaries side by side as Markdown: ms per step by kind of work for each (headed by
/// its file's name, with as much of its path as tells the files apart), and each one's
/// difference from the first: where one run's time goes that another's does not.
pub fn compare(summaries: &[TraceSummary]) -> String {
    let per = |s: &TraceSummary, w: Option<Work>| {
        let ms = match w {
            Some(w) => s.by_work.iter().find(|x| x.work == w).map_or(0.0, |x| x.ms),
            None => s.busy_ms,
        };
        ms / s.steps as f64
    };
    let Some(first) = summaries.first() else { return String::new() };
    // Each file by the shortest end of its path that no other file's has (`steps_2-3` alone
    // would head two runs' columns alike), without its extension.
    let names = crate::console::path_names::shortest_distinct(
        &summaries.iter().map(|s| Path::new(&s.path).with_extension("")).collect::<Vec<_>>(),
    );
    let mut out = format!("ms per step ({})\n\n| work |", first.counted);
    for name in &names {
        out += &format!(" {name} |");
    }
    for name in &names[1..] {
        out += &format!(" {name} − {} |", names[0]);
    }
    out += &format!("\n|---|{}\n", "---|".repeat(2 * summaries.len() - 1));
    // Kinds in the first's order of weight, then the rest; kinds no run spent time on left out.
    let mut kinds: Vec<Work> = first.by_work.iter().map(|w| w.work).collect();
    let rest: Vec<Work> = Work::ALL
        .iter()
        .copied()
        .filter(|w| !kinds.contains(w) && summaries.iter().any(|s| per(s, Some(*w)) > 0.0))
        .collect();
    kinds.extend(rest);
    for row in kinds.into_iter().map(Some).chain([None]) {
        out += &format!("| {} |", row.map_or("all", Work::name));
        for s in summaries {
            out += &format!(" {:.2} |", per(s, row));
        }
        for s in &summaries[1..] {
            out += &format!(" {:+.2} |", per(s, row) - per(first, row));
        }
        out += "\n";
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(device_side: bool, lane: u64, start_ns: u64, end_ns: u64, name: &str) -> TraceEvent {
        TraceEvent {
            device_side,
            launch: false,
            correlation: None,
            lane,
            start_ns,
            end_ns,
            name: name.into(),
        }
    }

    /// A kernel on stream 7 and its launch on thread 1, tied by `correlation`.
    fn launched(correlation: u64, at_ns: u64, start_ns: u64, end_ns: u64, kernel: &str) -> [TraceEvent; 2] {
        let launch = TraceEvent {
            launch: true,
            correlation: Some(correlation),
            ..ev(false, 1, at_ns, at_ns + 5, "cudaLaunchKernel")
        };
        [launch, TraceEvent { correlation: Some(correlation), ..ev(true, 7, start_ns, end_ns, kernel) }]
    }

    /// Each kernel's time goes to the operators around its launch, outermost › innermost; the
    /// launches themselves are neither operators nor work.
    #[test]
    fn gpu_time_goes_to_the_operators_that_launched_it() {
        let mut events = vec![
            ev(false, 1, 0, 10_000, "trainguard step 3"),
            ev(false, 1, 100, 1_000, "aten::linear"),
            ev(false, 1, 200, 900, "aten::addmm"),
            ev(false, 1, 2_000, 5_000, "autograd::engine::evaluate_function: AddmmBackward0"),
            ev(false, 1, 2_100, 2_900, "aten::sum"),
            ev(false, 1, 3_000, 3_500, "aten::sum"),
            ev(false, 1, 6_000, 6_400, "aten::add_"),
        ];
        events.extend(launched(1, 300, 1_000, 4_000, "nvjet_tst_gemm"));
        events.extend(launched(2, 2_200, 4_000, 4_500, "reduce_kernel"));
        events.extend(launched(3, 3_100, 4_500, 5_000, "reduce_kernel"));
        events.extend(launched(4, 6_100, 6_200, 6_300, "add_kernel"));
        events.extend(launched(5, 7_000, 7_000, 7_100, "add_kernel")); // launched outside any operator
        events.push(TraceEvent { correlation: Some(99), ..ev(true, 7, 8_000, 8_200, "orphan") }); // its launch is not in the trace
        let got = by_operator(&events);
        let want = [
            ("aten::linear › aten::addmm", 3_000, 1),
            ("autograd::engine::evaluate_function: AddmmBackward0 › aten::sum", 1_000, 2),
            (NO_OPERATOR, 300, 2),
            ("aten::add_", 100, 1),
        ];
        assert_eq!(
            got,
            want.map(|(op, ns, k)| OperatorTime { operator: op.into(), ms: ns as f64 / 1e6, kernels: k })
        );
        let s = summarise(&events, Path::new("t.json"), TOP);
        assert_eq!((s.counted.as_str(), s.busy_ms), ("gpu kernels", 0.0044), "launches are not work");
        assert!(s.top.iter().all(|n| n.name != "cudaLaunchKernel"));
        let t = table(&s);
        assert!(t.contains("| launched by | ms per step | kernels per step |"), "{t}");
        assert!(t.contains("| `aten::linear › aten::addmm` | 0.00 | 1 |"), "{t}");
        // Without GPU events nothing is attributed; the CPU's self times ignore the launches.
        let cpu: Vec<TraceEvent> = events.iter().filter(|e| !e.device_side).cloned().collect();
        let c = summarise(&cpu, Path::new("t.json"), TOP);
        assert!(c.by_operator.is_empty() && c.top.iter().all(|n| n.name != "cudaLaunchKernel"));
    }

    /// Kernel and operator names of the forms PyTorch's profiler reports on CUDA (cuBLAS,
    /// CUTLASS, ATen's and our kernels; the first from issue 15's profile) and on the CPU.
    #[test]
    fn names_get_their_kind_of_work() {
        let cases = [
            ("cutlass_75_tensorop_bf16_s1688gemm_bf16_128x128_32x1_tn_align2", Work::Gemm),
            ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas", Work::Gemm),
            ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", Work::Gemm),
            ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t>, false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)", Work::Attention),
            ("fmha_cutlassB_f32_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch::Sm80, float, true, false, false, 64, 64, 64, false>::Params)", Work::Attention),
            ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float, float const*, float const*, float const*, float*, float*, float*)", Work::Norm),
            ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float, 32u, 32u, 256u, false, false>(long, long, float const*, float const*, float const*, float const*, float*, float*)", Work::Norm),
            ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)", Work::Loss),
            ("tg_ce_backward_bf16", Work::Loss),
            ("tg_ce_forward_grad_bf16", Work::Loss),
            // cuDNN's attention backward's helpers (its dO·O row sums, dQ's conversion).
            ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, void*, ...)", Work::Attention),
            // Our NVRTC kernels by what they do (the residual norm's also for RMSNorm).
            ("tg_ln_forward_warp_bf16", Work::Norm),
            ("tg_ln_param_grads_bf16", Work::Norm),
            ("tg_col_sum_bands_packed_bf16", Work::Reduce),
            ("tg_col_sum_finish", Work::Reduce),
            ("tg_gelu_backward_bands_bf16", Work::Elementwise),
            ("tg_swiglu_backward_bf16", Work::Elementwise),
            ("tg_rope_bf16", Work::Elementwise),
            ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, float*, float*>(...)", Work::Optimizer),
            ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#10}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, ...)", Work::Copy),
            ("Memcpy HtoD (Pageable -> Device)", Work::Copy),
            ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4, 4> >(...)", Work::Reduce),
            ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#4}::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, ...)", Work::Elementwise),
            ("void at::native::embedding_backward_feature_kernel<float, float, long>(long const*, float const*, float*, int, long, int)", Work::Embedding),
            ("aten::addmm", Work::Gemm),
            ("aten::native_layer_norm", Work::Norm),
            ("aten::_fused_adamw_", Work::Optimizer),
            ("aten::to", Work::Copy),
            ("aten::copy_", Work::Copy),
            ("aten::add_", Work::Elementwise),
            ("aten::sum", Work::Reduce),
            ("aten::_scaled_dot_product_flash_attention_for_cpu", Work::Attention),
            ("autograd::engine::evaluate_function: AddmmBackward0", Work::Other),
            // Inductor's kernels (torch.compile) are named after the ops they fuse: the first
            // rule that matches names the kind.
            ("triton_per_fused__to_copy_add_native_layer_norm_native_layer_norm_backward_7", Work::Norm),
            ("triton_red_fused__log_softmax__to_copy_nll_loss_forward_3", Work::Loss),
            ("triton_poi_fused__to_copy_gelu_4", Work::Copy),
        ];
        for (name, work) in cases {
            assert_eq!(work_of(name), work, "{name}");
        }
    }

    #[test]
    fn cpu_self_time_subtracts_what_an_operator_called() {
        // Thread 1: linear [0, 100) calls addmm [10, 90), which calls mm-ish [20, 50);
        // then add [100, 120). Thread 2 overlaps in time and is counted on its own.
        let events = [
            ev(false, 1, 0, 100, "aten::linear"),
            ev(false, 1, 10, 90, "aten::addmm"),
            ev(false, 1, 20, 50, "aten::copy_"),
            ev(false, 1, 100, 120, "aten::add"),
            ev(false, 2, 5, 65, "aten::mul"),
        ];
        let mut got = cpu_self_times(&events);
        got.sort();
        let want = [
            ("aten::add", 20),
            ("aten::addmm", 50),
            ("aten::copy_", 30),
            ("aten::linear", 20),
            ("aten::mul", 60),
        ];
        assert_eq!(got, want.map(|(n, d)| (n.to_string(), d)));
        let total: u64 = got.iter().map(|(_, d)| d).sum();
        assert_eq!(total, 120 + 60, "self times add up to the time each thread was busy");
    }

    #[test]
    fn gpu_kernels_are_counted_when_there_are_any_and_figures_are_per_marked_step() {
        let events = [
            ev(false, 1, 0, 2_500_000, "trainguard step 10"),
            ev(false, 1, 2_500_000, 5_000_000, "trainguard step 11"),
            ev(false, 1, 0, 1_000_000, "aten::addmm"),
            ev(true, 7, 0, 3_000_000, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT"),
            ev(true, 7, 3_000_000, 4_000_000, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT"),
            ev(true, 7, 4_000_000, 5_000_000, "tg_ce_forward_bf16"),
        ];
        let s = summarise(&events, Path::new("t.json"), TOP);
        assert_eq!((s.first_step, s.steps), (Some(10), 2));
        assert_eq!((s.counted.as_str(), s.busy_ms, s.span_ms), ("gpu kernels", 5.0, 5.0));
        assert_eq!(s.by_work[0], WorkTime { work: Work::Gemm, ms: 4.0, share: 0.8, calls: 2 });
        assert_eq!(s.by_work[1].work, Work::Loss);
        assert_eq!((s.top[0].calls, s.top[0].ms, s.top.len()), (2, 4.0, 2));
        assert_eq!(summarise(&events, Path::new("t.json"), 1).top.len(), 1, "the heaviest name only");
        let t = table(&s);
        assert!(t.starts_with("t.json: steps 10-11, gpu kernels 2.50 ms per step"), "{t}");
        assert!(t.contains("| gemm | 2.00 | 80.0% | 1 |"), "{t}");
        // Without GPU events: the CPU operators' self times; the step ranges are not operators.
        let cpu = summarise(&events[..3], Path::new("t.json"), TOP);
        assert_eq!((cpu.counted.as_str(), cpu.busy_ms, cpu.top.len()), ("cpu operators", 1.0, 1));
        let unmarked = summarise(&events[2..3], Path::new("t.json"), TOP);
        assert_eq!((unmarked.first_step, unmarked.steps), (None, 1));
    }

    /// A step whose range appears twice (two threads, or a profiler that marks it again) is one
    /// step: figures per step divide by the distinct steps, and the heading names those, with
    /// any gap between them said rather than spanned by a range.
    #[test]
    fn steps_are_counted_by_their_numbers_not_by_their_ranges() {
        let mut events = vec![
            ev(false, 1, 0, 1_000_000, "trainguard step 1"),
            ev(false, 2, 0, 1_000_000, "trainguard step 1"),
            ev(false, 1, 1_000_000, 2_000_000, "trainguard step 2"),
            ev(true, 7, 0, 3_000_000, "nvjet_tst_128x256"),
            ev(true, 7, 3_000_000, 4_000_000, "nvjet_tst_128x256"),
        ];
        let s = summarise(&events, Path::new("t.json"), TOP);
        assert_eq!((s.first_step, s.steps, &s.step_numbers[..]), (Some(1), 2, &[1, 2][..]));
        let t = table(&s);
        assert!(t.starts_with("t.json: steps 1-2, gpu kernels 2.00 ms per step"), "{t}");
        assert!(t.contains("| gemm | 2.00 | 100.0% | 1 |"), "calls per step too: {t}");
        assert!(compare(&[s.clone(), s]).contains("| gemm | 2.00 | 2.00 | +0.00 |"));
        // Steps 1, 2 and 5: three steps, and not "steps 1-3" nor "steps 1-5".
        events.push(ev(false, 1, 5_000_000, 6_000_000, "ProfilerStep#5"));
        let gap = summarise(&events, Path::new("t.json"), TOP);
        assert_eq!((gap.steps, &gap.step_numbers[..]), (3, &[1, 2, 5][..]));
        let t = table(&gap);
        assert!(
            t.starts_with("t.json: steps 1-2, 5 (3 steps, not contiguous), gpu kernels 1.33 ms per step"),
            "{t}"
        );
        assert_eq!(steps_label(&[3]), "step 3");
        assert_eq!(steps_label(&[1, 3, 4, 5, 9]), "steps 1, 3-5, 9 (5 steps, not contiguous)");
    }

    #[test]
    fn summaries_side_by_side_show_each_kinds_difference_from_the_first() {
        let ours = summarise(
            &[
                ev(false, 1, 0, 10_000_000, "trainguard step 4"),
                ev(true, 7, 0, 6_000_000, "nvjet_tst_128x256"),
                ev(true, 7, 6_000_000, 9_000_000, "vectorized_layer_norm_kernel"),
            ],
            Path::new("dir/gpt2-trainguard.json"),
            TOP,
        );
        let theirs = summarise(
            &[
                ev(true, 7, 0, 5_000_000, "nvjet_tst_128x256"),
                ev(true, 7, 5_000_000, 6_000_000, "tg_ce_forward_bf16"),
            ],
            Path::new("dir/gpt2-compile.json"),
            TOP,
        );
        let t = compare(&[ours, theirs]);
        assert!(
            t.contains("| work | gpt2-trainguard | gpt2-compile | gpt2-compile − gpt2-trainguard |"),
            "{t}"
        );
        assert!(t.contains("| gemm | 6.00 | 5.00 | -1.00 |"), "{t}");
        assert!(t.contains("| norm | 3.00 | 0.00 | -3.00 |"), "{t}");
        assert!(t.contains("| loss | 0.00 | 1.00 | +1.00 |"), "a kind only the second has: {t}");
        assert!(t.trim_end().ends_with("| all | 9.00 | 6.00 | -3.00 |"), "{t}");
        assert!(!t.contains("| copy |"), "kinds nobody spent time on are left out: {t}");
    }

    /// Two runs' traces of the same steps share their file's name: the columns are headed by
    /// as much of each path as tells them apart.
    #[test]
    fn traces_of_the_same_name_are_told_apart_by_their_paths() {
        let of =
            |path: &str| summarise(&[ev(true, 7, 0, 1_000_000, "nvjet_tst_128x256")], Path::new(path), TOP);
        let t = compare(&[of("A/trace/steps_1-2.json"), of("B/trace/steps_1-2.json")]);
        assert!(
            t.contains(
                "| work | A/trace/steps_1-2 | B/trace/steps_1-2 | B/trace/steps_1-2 − A/trace/steps_1-2 |"
            ),
            "{t}"
        );
    }

    /// A complete event of a kind counted whose `ts` or `dur` cannot be used is left out, and
    /// counted by reason (one each, the first: `ts`, then `dur`, then `name`) for a warning.
    #[test]
    fn unusable_events_are_counted_by_why_they_were_skipped() {
        let trace = serde_json::json!({"traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "nvjet_tst", "tid": 7, "ts": 100.0, "dur": 2.0},
            {"ph": "X", "cat": "kernel", "name": "nvjet_tst", "tid": 7, "ts": 110.0},
            {"ph": "X", "cat": "kernel", "name": "nvjet_tst", "tid": 7, "ts": 120.0, "dur": null},
            {"ph": "X", "cat": "kernel", "name": "nvjet_tst", "tid": 7, "ts": 130.0, "dur": -1.0},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 140.0, "dur": "3"},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": null, "dur": -3.0},
            {"ph": "X", "cat": "cpu_op", "tid": 1, "ts": 150.0, "dur": 1.0},
            // Not of a kind counted: left out without a word, whatever its fields.
            {"ph": "X", "cat": "python_function", "name": "f", "ts": null},
            {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1.0}
        ]});
        let Parsed { events, skipped } = parse(&trace).unwrap();
        assert_eq!(events, [ev(true, 7, 0, 2_000, "nvjet_tst")]);
        let why = |why: &str, events: u64| Skipped { why: why.into(), events };
        assert_eq!(
            skipped,
            [
                why("`dur` missing", 1),
                why("`dur` negative", 1),
                why("`dur` not a number", 1),
                why("`dur` null", 1),
                why("`name` missing or not text", 1),
                why("`ts` null", 1)
            ]
        );
        let s = summary_of(trace.to_string().as_bytes(), Path::new("t.json"), TOP).unwrap();
        assert_eq!((s.busy_ms, s.skipped.len()), (0.002, 6));
        let warning = s.skipped_warning().unwrap();
        assert!(warning.starts_with("t.json: the figures leave out 6 events they could not read: 1 with `dur` missing, 1 with `dur` negative"), "{warning}");
        assert!(warning.ends_with("1 with `ts` null"), "{warning}");
        assert_eq!(
            summarise(&events, Path::new("t.json"), TOP).skipped_warning(),
            None,
            "nothing to say when all were read"
        );
    }

    /// Nothing to count is an error that says why, not a table of zeros: an empty list, only
    /// events of other kinds (or step ranges), or only unusable ones (and why they were).
    #[test]
    fn a_trace_with_nothing_to_count_is_an_error() {
        let empty = |json: Value| match summary_of(json.to_string().as_bytes(), Path::new("t.json"), TOP) {
            Err(TraceError::Empty { why, .. }) => why,
            other => panic!("{other:?}"),
        };
        assert_eq!(empty(serde_json::json!({"traceEvents": []})), "its event list is empty");
        assert_eq!(empty(serde_json::json!([])), "its event list is empty");
        let other = empty(
            serde_json::json!([{"ph": "X", "cat": "python_function", "name": "f", "ts": 1, "dur": 1}, {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 1, "dur": 1}]),
        );
        assert!(other.starts_with("of its 2 events, none is a kernel"), "{other}");
        let bad = empty(
            serde_json::json!([{"ph": "X", "cat": "kernel", "name": "k", "ts": 1}, {"ph": "X", "cat": "kernel", "name": "k", "ts": 2}]),
        );
        assert!(bad.ends_with("; 2 events could not be read: 2 with `dur` missing"), "{bad}");
        let e = summary_of(b"{\"traceEvents\": []}", Path::new("t.json"), TOP).unwrap_err();
        assert!(e.is_usage(), "exit code 2");
        assert_eq!(e.to_string(), "t.json holds nothing to tabulate: its event list is empty");
    }

    /// Timestamps past u64 nanoseconds (2e16 µs: a clock in nanoseconds written as
    /// microseconds) keep their durations and gaps; they overflowed to 0.00 ms.
    #[test]
    fn huge_timestamps_keep_their_durations() {
        let trace = serde_json::json!({"traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "tid": 1, "ts": 2.0e16, "dur": 4000.0},
            {"ph": "X", "cat": "kernel", "name": "nvjet_tst", "tid": 7, "ts": 2.0e16, "dur": 1500.0},
            {"ph": "X", "cat": "kernel", "name": "nvjet_tst", "tid": 7, "ts": 2.0e16 + 2048.0, "dur": 500.0},
            // 584 years past the first: past u64 nanoseconds even from there.
            {"ph": "X", "cat": "kernel", "name": "nvjet_tst", "tid": 7, "ts": 2.0e16 + 1.9e16, "dur": 1.0}
        ]});
        let s = summary_of(trace.to_string().as_bytes(), Path::new("t.json"), TOP).unwrap();
        assert_eq!((s.busy_ms, s.span_ms), (2.0, 4.0));
        assert_eq!(s.by_work[0], WorkTime { work: Work::Gemm, ms: 2.0, share: 1.0, calls: 2 });
        assert_eq!(
            s.skipped,
            [Skipped { why: "`ts` + `dur` past 584 years after the first event".into(), events: 1 }]
        );
        // Durations that add up past u64 saturate rather than wrap round to a small sum.
        let huge = [7, 8, 9].map(|stream| ev(true, stream, 0, u64::MAX / 2, "nvjet_tst"));
        assert_eq!(summarise(&huge, Path::new("t.json"), TOP).busy_ms, u64::MAX as f64 / 1e6);
    }

    /// `tensorboard_trace_handler(use_gzip=True)`'s `.pt.trace.json.gz` is named for what it is
    /// (no gzip decoder among our dependencies), not "not valid UTF-8"; the JSON Array Format
    /// (the events without the object around them) is read as the event list.
    #[test]
    fn gzip_is_named_and_a_bare_event_list_is_read() {
        let gz = [0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0xab, 0xff, 0x00];
        let e = summary_of(&gz, Path::new("steps_1-2.pt.trace.json.gz"), TOP).unwrap_err();
        assert!(matches!(e, TraceError::Gzip { .. }) && e.is_usage(), "{e:?}");
        assert!(e.to_string().starts_with("steps_1-2.pt.trace.json.gz is gzip-compressed"), "{e}");
        assert!(e.to_string().ends_with("gunzip it first, `gunzip -c steps_1-2.pt.trace.json.gz > steps_1-2.pt.trace.json`, and give that file"), "{e}");
        let other = summary_of(&gz, Path::new("trace.bin"), TOP).unwrap_err().to_string();
        assert!(other.contains("`gunzip -c trace.bin > trace.json`"), "{other}");
        let list = serde_json::json!([
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "tid": 1, "ts": 0.0, "dur": 10.0},
            {"ph": "X", "cat": "kernel", "name": "nvjet_tst", "tid": 7, "ts": 1.0, "dur": 3.0}
        ]);
        let s = summary_of(list.to_string().as_bytes(), Path::new("a.json"), TOP).unwrap();
        assert_eq!((s.first_step, s.busy_ms, s.top[0].name.as_str()), (Some(4), 0.003, "nvjet_tst"));
        assert!(parse(&serde_json::json!("text")).unwrap_err().contains("not a Chrome trace"));
    }

    /// What Kineto writes (the shape of `torch.profiler`'s export and of ours): only complete
    /// events of the GPU's and the CPU's kinds are read; microseconds become nanoseconds.
    #[test]
    fn chrome_trace_events_are_read_and_the_rest_left_out() {
        let trace = serde_json::json!({
            "schemaVersion": 1,
            "traceEvents": [
                {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "pid": 9, "tid": 9, "ts": 4798773604303.147, "dur": 34131.524},
                {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 9, "tid": 9, "ts": 4798773604337.338, "dur": 23.625},
                {"ph": "X", "cat": "kernel", "name": "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "pid": 0, "tid": 7, "ts": 4798773604340.0, "dur": 10.5, "args": {"correlation": 41}},
                {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "pid": 0, "tid": "stream 7", "ts": 4798773604351.0, "dur": 1.0},
                {"ph": "X", "cat": "python_function", "name": "train.py(12): step", "pid": 9, "tid": 9, "ts": 4798773604300.0, "dur": 50000.0},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 9, "tid": 9, "ts": 4798773604338.0, "dur": 4.0, "args": {"correlation": 41}},
                {"ph": "s", "cat": "ac2g", "name": "ac2g", "pid": 9, "tid": 9, "ts": 4798773604338.0, "id": 1},
                {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}}
            ]
        });
        let Parsed { events, skipped } = parse(&trace).unwrap();
        assert_eq!((events.len(), skipped.len()), (5, 0), "{events:?}");
        assert_eq!(
            (events[4].launch, events[4].correlation, events[2].correlation),
            (true, Some(41), Some(41)),
            "the launch and its kernel"
        );
        // From the earliest start read (ProfilerStep#3's; the Python function's is not read),
        // to the nanosecond: 4798773604337.338 µs − 4798773604303.147 µs.
        assert_eq!(events[1], ev(false, 9, 34_191, 34_191 + 23_625, "aten::mm"));
        assert_eq!(
            (events[2].device_side, events[2].lane, events[2].end_ns - events[2].start_ns),
            (true, 7, 10_500)
        );
        assert_eq!((events[3].device_side, events[3].lane), (true, 7), "a stream written as text");
        let s = summarise(&events, Path::new("p.json"), TOP);
        assert_eq!((s.first_step, s.steps, s.counted.as_str()), (Some(3), 1, "gpu kernels"));
        assert!((s.busy_ms - 0.0115).abs() < 1e-12, "{}", s.busy_ms);
        assert_eq!(s.by_operator[0].operator, "aten::mm", "the kernel launched inside aten::mm");
        assert!(parse(&serde_json::json!({"events": []})).unwrap_err().contains("traceEvents"));
    }
}
