//! What `trainguard plan` prints: the estimate table, the recommendation (or the gap and the
//! levers), the profile's estimate-vs-measured table and the `--apply` diff; or all of it as one
//! JSON object (`--json`, schema [`SCHEMA`]; every size in bytes).
use super::apply::Applied;
use super::estimate::Estimate;
use super::gpu::GpuTarget;
use super::profile::{Outcome, ProfileReport};
use super::recommend::Recommendation;
use super::shape::{PrecisionBytes, Setup, Target, Transformer};
use super::sharding::Levels;
use crate::config::Arch;
use serde::Serialize;
use std::fmt::Write;

/// Bumped when a field changes meaning or disappears.
pub const SCHEMA: u32 = 1;

#[derive(Debug, Serialize)]
pub struct Report<'a> {
    pub schema: u32,
    /// The config file, or "command line".
    pub source: &'a str,
    pub model: &'a Transformer,
    pub params: u64,
    pub setup: &'a Setup,
    pub global_batch: Option<u64>,
    pub gpus: u64,
    pub micro_batch: u64,
    /// None without a global batch.
    pub accumulation: Option<u64>,
    pub estimate: &'a Estimate,
    pub gpu: Option<&'a GpuTarget>,
    pub recommendation: Option<&'a Recommendation>,
    /// Each `dist.shard` level (and offload) at this world size, and the cheapest that fits.
    pub levels: Option<&'a Levels>,
    pub profile: Option<&'a ProfileReport>,
    pub applied: Option<&'a Applied>,
}

const GIB: f64 = (1u64 << 30) as f64;
const MIB: f64 = (1u64 << 20) as f64;

/// The busiest GPU's share of a global batch `global` in micro-steps of `micro`: `21 × 12 + 4`.
fn per_gpu_steps(global: u64, micro: u64, gpus: u64) -> String {
    let share =
        crate::data::batch::rank_share(global as usize, gpus.max(1) as usize).unwrap_or(global as usize);
    crate::data::batch::micro_steps_in_words(share, micro as usize)
}

/// `12.34 GiB` or `56.7 MiB`.
pub fn size(bytes: f64) -> String {
    if bytes.abs() >= GIB {
        format!("{:.2} GiB", bytes / GIB)
    } else {
        format!("{:.1} MiB", bytes / MIB)
    }
}

fn count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

pub fn render(r: &Report) -> String {
    let mut o = String::new();
    let (m, s, e) = (r.model, r.setup, r.estimate);
    let _ = writeln!(o, "trainguard plan: {}", r.source);
    let arch = arch_name(m.arch);
    let params = match m.params_override {
        Some(_) => {
            format!("{} parameters (--params; {arch} layout: {})", count(r.params), count(m.layout_params()))
        }
        None => format!("{} parameters", count(r.params)),
    };
    let _ = writeln!(o, "model     {params}; {arch}: {}", model_parts(m));
    let _ = writeln!(
        o,
        "training  {}, {}, {} attention, activation checkpointing {}{}{}",
        s.precision.name(),
        s.optimizer.name(),
        if s.flash { "flash" } else { "materialised" },
        match (s.activation_checkpointing, s.checkpoint_blocks, s.checkpoint_first) {
            (false, _, _) => "off".to_string(),
            (true, _, Some(f)) if f < m.layers => format!("on (the first {f} of {} blocks)", m.layers),
            (true, k, _) if k <= 1 => "on (every block)".to_string(),
            (true, k, _) => format!("on (segments of {k} blocks)"),
        },
        s.loss_chunk_tokens.map_or(String::new(), |c| format!(", loss in chunks of {c} tokens")),
        if s.dropout { ", dropout" } else { "" }
    );
    let batch = match (r.global_batch, r.accumulation) {
        (Some(g), Some(k)) if r.micro_batch * k * r.gpus == g => format!("micro-batch {} × accumulation {k} × {} GPU(s) = global {g}", r.micro_batch, r.gpus),
        (Some(g), Some(k)) => format!(
            "micro-batch {} × accumulation {k} × {} GPU(s) ≥ global {g} ({} a GPU: the last micro-step takes the remainder)",
            r.micro_batch,
            r.gpus,
            per_gpu_steps(g, r.micro_batch, r.gpus)
        ),
        _ => format!("micro-batch {} (no global batch: gradients assumed held across micro-steps)", r.micro_batch),
    };
    let _ = writeln!(o, "batch     {batch}");

    // One unit for the whole table: GiB for real models, MiB for toys.
    let (unit, div) = if e.total as f64 >= GIB { ("GiB", GIB) } else { ("MiB", MIB) };
    let v = |b: u64| if b == 0 { "—".to_string() } else { format!("{:.3}", b as f64 / div) };
    let dtype = if s.precision.logit_bytes() == 4 { "fp32" } else { "bf16" };
    // Our loss keeps the logits in the head's dtype, then their gradient beside them or over them.
    let (logit_dtype, cross_entropy) = match (s.fused_cross_entropy, s.loss_gradient_in_forward()) {
        // Under CUDA autocast the logits' gradient is 16-bit beside the log-probabilities' fp32 one.
        (false, _) if s.target == Target::Cuda && s.precision.is_mixed() => {
            (dtype, format!("cross-entropy (log-softmax gradients, {dtype} and 16-bit)"))
        }
        (false, _) => (dtype, format!("cross-entropy (log-softmax gradients, {dtype})")),
        (true, in_forward) => {
            let d = if s.precision.activation_bytes() == 4 { "fp32" } else { "16-bit" };
            let what = if in_forward {
                "gradient written over the logits".to_string()
            } else {
                format!("the logits' gradient, {d}")
            };
            (d, format!("cross-entropy ({what})"))
        }
    };
    let mut rows: Vec<(String, String)> = vec![
        (
            format!("weights ({})", if s.precision.weight_bytes() == 4 { "fp32" } else { "16-bit" }),
            v(e.weights),
        ),
        ("fp32 master weights".into(), v(e.master_weights)),
        (
            format!("gradients ({})", if s.precision.grad_bytes() == 4 { "fp32" } else { "bf16" }),
            v(e.gradients),
        ),
        (format!("optimizer state ({})", s.optimizer.name()), v(e.optimizer)),
        (
            format!(
                "activations: {} {unit}/layer × {} + {} outside{}",
                v(e.activations_per_layer),
                s.live_blocks(m),
                v(e.activations_outside),
                if s.activation_checkpointing { " (checkpointed)" } else { "" }
            ),
            v(e.activations),
        ),
        (
            format!(
                "logits ({}, {logit_dtype})",
                if s.loss_chunk_tokens.is_some() { "one chunk × v" } else { "b·s·v" }
            ),
            v(e.logits),
        ),
        (cross_entropy, v(e.cross_entropy)),
    ];
    if e.buffers > 0 {
        rows.insert(4, ("buffers (RoPE cos and sin tables, fp32)".into(), v(e.buffers)));
    }
    let sh = &e.sharding;
    if sh.shard != crate::config::ShardLevel::None && r.gpus > 1 {
        let i = rows.iter().position(|(n, _)| n.starts_with("optimizer state")).unwrap_or(0);
        rows[i].0 =
            format!("{} of the {:.1}% of parameters this rank owns", rows[i].0, sh.owned_share * 100.0);
    }
    if s.offload_optimizer && s.target == Target::Cuda {
        let i = rows.iter().position(|(n, _)| n.starts_with("optimizer state")).unwrap_or(0);
        rows[i].0 = format!("{} (in host memory: {})", rows[i].0, size(sh.host_bytes as f64));
    }
    let host_copies = if s.target == Target::Cpu { sh.host_copies } else { 0 };
    if host_copies > 0 {
        rows.push(("host copies of the parameters the update runs on (offload)".into(), v(host_copies)));
    }
    if e.dp_buffers > 0 {
        rows.push(("data-parallel gradient buckets".into(), v(e.dp_buffers)));
    }
    // The rows are what exists at the start of backward; the peak may be elsewhere, holding
    // more (gradients being made) or less (activations freed): the difference, so they add up.
    let listed =
        e.states() + e.buffers + e.activations + e.logits + e.cross_entropy + e.dp_buffers + host_copies;
    if e.peak_allocated > listed {
        rows.push((format!("+ also alive at the peak ({})", e.peak_phase), v(e.peak_allocated - listed)));
    } else if e.peak_allocated < listed {
        rows.push((
            format!("− not alive together at the peak ({})", e.peak_phase),
            format!("−{}", v(listed - e.peak_allocated)),
        ));
    }
    rows.push(("= peak allocated".into(), v(e.peak_allocated)));
    rows.push((
        format!("allocator fragmentation margin ({:.0}%)", s.fragmentation * 100.0),
        v(e.fragmentation),
    ));
    rows.push(("CUDA context and workspaces".into(), v(e.cuda_overhead)));
    rows.push(("= total per GPU".into(), v(e.total)));
    if e.checkpoint_copy > 0 {
        rows.push(("host memory: background checkpoint copy".into(), v(e.checkpoint_copy)));
    }
    let width = rows.iter().map(|(name, _)| name.chars().count()).max().unwrap_or(0).max(50);
    let _ =
        writeln!(o, "\n  {:<width$} {unit:>10}", format!("memory per GPU at micro-batch {}", r.micro_batch));
    for (name, value) in rows {
        let _ = writeln!(o, "  {name:<width$} {value:>10}");
    }
    let _ = writeln!(
        o,
        "  fixed {} + {} per sample of the micro-batch (while accumulating){}",
        size(e.fixed as f64),
        size(e.per_sample as f64),
        if r.accumulation == Some(1) && e.gradients > 0 {
            "; with accumulation 1 the gradients replace the activations at the end of backward, so the total is lower"
        } else {
            ""
        }
    );
    if e.peak_phase == "last block's backward" {
        let _ = writeln!(
            o,
            "  the peak is in the last block's backward: its MLP and residual gradients ({}) outweigh logits and cross-entropy, \
             which are freed by then",
            size(e.block_backward_transient as f64)
        );
    }
    if e.peak_phase == "end of backward" {
        let summed = match e.embedding_grad_transient {
            0 => String::new(),
            b => format!(" plus the tied embedding's partial gradients being summed ({})", size(b as f64)),
        };
        let _ = writeln!(o, "  the peak is at the end of backward: gradients complete{summed}, more than activations, logits and cross-entropy");
    }
    if e.peak_phase == "first blocks' recomputed backward" {
        let _ = writeln!(
            o,
            "  the peak is in the first blocks' recomputed backward: every later block's gradient and the head's are held while the first segment's activations are made again"
        );
    }
    if e.states() > 0 {
        let _ = writeln!(
            o,
            "  before the first activation (weights, master, gradients, optimizer): {} ({:.1} GB)",
            size(e.states() as f64),
            e.states() as f64 / 1e9
        );
    }

    match (r.gpu, r.recommendation) {
        (Some(g), Some(rec)) => render_recommendation(&mut o, r, g, rec),
        _ => {
            let _ =
                writeln!(o, "\nno GPU given: add --gpu NAME|auto or --gpu-memory SIZE for a recommendation");
        }
    }
    if let Some(l) = r.levels {
        render_levels(&mut o, r, l);
    }
    if let Some(p) = r.profile {
        render_profile(&mut o, r, p);
    }
    if let Some(a) = r.applied {
        render_applied(&mut o, a, r.gpus);
    }
    o
}

/// The level table: per-rank memory, bytes each rank sends a step, and the level chosen.
fn render_levels(o: &mut String, r: &Report, l: &Levels) {
    let name = |row: &super::sharding::LevelPlan| {
        format!("{}{}", row.shard.name(), if row.offload_optimizer { " + offload" } else { "" })
    };
    let _ = writeln!(
        o,
        "\nper rank by dist.shard over {} rank(s) (the busiest rank; bytes sent a step in fp32):",
        l.world_size
    );
    let _ = writeln!(
        o,
        "  {:<20} {:>7} {:>12} {:>12} {:>12} {:>12} {:>7} {:>12}",
        "level", "owns", "optimizer", "host", "sent/step", "peak alloc", "micro", "total"
    );
    for row in &l.rows {
        let k = &row.rank;
        let _ = writeln!(
            o,
            "  {:<20} {:>6.1}% {:>12} {:>12} {:>12} {:>12} {:>7} {:>12}{}",
            name(row),
            k.owned_share * 100.0,
            size(k.optimizer_state as f64),
            if k.host_bytes > 0 { size(k.host_bytes as f64) } else { "—".into() },
            size(k.comm.total() as f64),
            size(row.peak_allocated_bytes as f64),
            row.micro_batch.map_or("—".into(), |b| b.to_string()),
            size(row.total_bytes as f64),
            if row.fits {
                ""
            } else if r.gpu.is_some() {
                "  does not fit"
            } else {
                ""
            }
        );
    }
    if r.gpu.is_some() {
        let _ = match l.chosen.map(|i| &l.rows[i]) {
            Some(row) => writeln!(
                o,
                "  → dist.shard: {}{} fits: micro-batch {}, {} a rank ({} peak allocated); order tried: {}",
                row.shard.name(),
                if row.offload_optimizer { " with memory.offload_optimizer: true" } else { "" },
                row.micro_batch.unwrap_or(1),
                size(row.total_bytes as f64),
                size(row.peak_allocated_bytes as f64),
                l.order
            ),
            None => writeln!(o, "  → no level fits, not even at micro-batch 1 (order tried: {})", l.order),
        };
        if let (None, Some(last)) = (l.chosen, l.rows.last()) {
            let _ = writeln!(
                o,
                "  on {}{} (saving at micro-batch 1):",
                last.shard.name(),
                if last.offload_optimizer { " + offload" } else { "" }
            );
            for lever in &l.levers {
                let _ = writeln!(
                    o,
                    "    - {:<60} saves {:>10} → {:>10}  {}",
                    lever.change,
                    size(lever.saving_bytes as f64),
                    size(lever.total_bytes as f64),
                    if lever.closes_gap { "fits" } else { "still over" }
                );
            }
        }
    }
}

fn arch_name(a: Arch) -> &'static str {
    match a {
        Arch::Gpt2 => "gpt2",
        Arch::Llama => "llama",
    }
}

/// The sizes and the parts that set the memory: `12 layers, hidden 768, 12 heads, …`.
fn model_parts(m: &Transformer) -> String {
    let (kv, bias) = (m.kv(), if m.bias { "biases" } else { "no biases" });
    let vocab = match m.padded_vocab() {
        p if p != m.vocab => format!("{} (padded to {p})", m.vocab),
        _ => m.vocab.to_string(),
    };
    match m.arch {
        Arch::Gpt2 => format!("{} layers, hidden {}, {} heads, vocab {vocab}, seq {}, MLP {}, {bias}", m.layers, m.hidden, m.heads, m.seq_len, m.ffn),
        Arch::Llama => format!(
            "{} layers, hidden {}, {} heads{}, RMSNorm, SwiGLU {}, RoPE, vocab {vocab}, seq {}, {} head, {bias}",
            m.layers,
            m.hidden,
            m.heads,
            if kv == m.heads { String::new() } else { format!(" sharing {kv} KV heads") },
            m.ffn,
            m.seq_len,
            if m.tied { "tied" } else { "untied" }
        ),
    }
}

fn render_recommendation(o: &mut String, r: &Report, g: &GpuTarget, rec: &Recommendation) {
    let origin = match (g.source.as_str(), g.total_bytes, g.free_bytes) {
        ("nvml", Some(t), Some(f)) => format!("NVML: {} total, {} free", size(t as f64), size(f as f64)),
        (src, _, _) => src.to_string(),
    };
    let _ = writeln!(
        o,
        "\nGPU       {} ({origin}): {} per GPU × {}; safety margin {} → budget {}",
        g.name,
        size(rec.capacity_bytes as f64),
        r.gpus,
        rec.margin,
        size(rec.budget_bytes as f64)
    );
    if let Some(note) = &g.note {
        let _ = writeln!(o, "          {note}");
    }
    if rec.fits {
        let micro = rec.micro_batch.unwrap_or(1);
        let split = match (rec.accumulation, r.global_batch) {
            (Some(k), Some(gb)) => {
                format!(
                    "micro-batch {micro} × accumulation {k} ({} a GPU; global {gb} over {} GPU(s))",
                    per_gpu_steps(gb, micro, r.gpus),
                    r.gpus
                )
            }
            _ => format!("micro-batch {micro}"),
        };
        let _ = writeln!(
            o,
            "fits      {split}: {} estimated, {:.0}% of the card",
            size(rec.total_bytes as f64),
            rec.utilisation * 100.0
        );
    } else {
        let _ = writeln!(
            o,
            "does not fit: micro-batch 1 needs {}, {} over the budget of {}",
            size(rec.total_bytes as f64),
            size(rec.over_by_bytes.unwrap_or(0) as f64),
            size(rec.budget_bytes as f64)
        );
        if rec.levers.is_empty() {
            let _ = writeln!(
                o,
                "          no lever modelled here helps: a larger GPU, or shard the model state (ZeRO/FSDP)"
            );
        } else {
            let _ = writeln!(o, "levers (saving at micro-batch 1, each on its own unless said):");
            for l in &rec.levers {
                let _ = writeln!(
                    o,
                    "  - {:<62} saves {:>11} → {:>11}  {}",
                    l.change,
                    size(l.saving_bytes as f64),
                    size(l.total_bytes as f64),
                    if l.closes_gap { "fits" } else { "still over" }
                );
            }
        }
    }
}

fn render_profile(o: &mut String, r: &Report, p: &ProfileReport) {
    let _ = writeln!(
        o,
        "\nprofile on {}: {} step(s) of {} micro-steps per size; budget {} of {}",
        p.device,
        p.steps,
        p.accumulation,
        size(p.budget_bytes as f64),
        size(p.capacity_bytes as f64)
    );
    let _ = writeln!(o, "  measured: {}", p.method);
    let _ = writeln!(
        o,
        "  {:>11} {:>13} {:>13} {:>8}  {:<21} outcome",
        "micro-batch", "estimate", "measured", "error", "estimated peak at"
    );
    for pt in &p.points {
        let measured = pt.measured_bytes.map_or("—".into(), |m| size(m as f64));
        let err = pt.error_pct.map_or("—".into(), |e| format!("{e:+.1}%"));
        let outcome = match pt.outcome {
            Outcome::Fits => "fits",
            Outcome::OverBudget => "over budget",
            Outcome::Retries => "the allocator retried (would thrash)",
            Outcome::OutOfMemory => "out of memory (caught by the guard)",
        };
        let _ = writeln!(
            o,
            "  {:>11} {:>13} {:>13} {:>8}  {:<21} {outcome}",
            pt.micro_batch,
            size(pt.estimate_bytes as f64),
            measured,
            err,
            pt.peak_phase
        );
    }
    match (&p.fit, &p.estimate_fit) {
        (Some(f), Some(e)) => {
            let _ = writeln!(
                o,
                "  least squares over {} sizes: measured {} + {} per sample; estimated {} + {} per sample",
                f.points,
                size(f.fixed_bytes),
                size(f.per_sample_bytes),
                size(e.fixed_bytes),
                size(e.per_sample_bytes)
            );
        }
        _ => {
            let _ = writeln!(o, "  no fit: fewer than two sizes ran");
        }
    }
    if !p.points.is_empty() {
        match (p.largest_fitting, p.micro_batch) {
            (Some(l), Some(b)) => {
                let acc = match (p.micro_accumulation, r.global_batch) {
                    (Some(k), Some(g)) => {
                        format!(" × accumulation {k} ({} a GPU)", per_gpu_steps(g, b, r.gpus))
                    }
                    (Some(k), None) => format!(" × accumulation {k}"),
                    _ => String::new(),
                };
                let _ =
                    writeln!(o, "  largest micro-batch that fits by measurement: {l} → micro-batch {b}{acc}");
            }
            _ if p.points.iter().all(|pt| pt.outcome != Outcome::Fits) => {
                // The search starts at 1; sizes given (`--micro-batches`) may not.
                let smallest = p.points.iter().map(|pt| pt.micro_batch).min().unwrap_or(1);
                let which = match smallest {
                    1 => "not even micro-batch 1".to_string(),
                    _ => format!(
                        "none of the sizes measured, the smallest {smallest} (smaller ones were not tried)"
                    ),
                };
                let _ = writeln!(
                    o,
                    "  nothing fits by measurement, {which}, within the budget of {}: raise the cap or shrink what a step holds (the memory savers and precisions: docs/memory-and-precision.md; for a GPU, `plan --gpu NAME` without --profile lists what each frees)",
                    size(p.budget_bytes as f64)
                );
            }
            _ => {}
        }
    }
}

fn render_applied(o: &mut String, a: &Applied, gpus: u64) {
    match &a.backup {
        Some(b) => {
            let _ = writeln!(o, "\napplied to {} (original kept as {}):", a.path.display(), b.display());
            o.push_str(&a.diff);
        }
        None => {
            let _ = writeln!(
                o,
                "\n{} already has micro_batch_size {}: nothing written",
                a.path.display(),
                a.micro_batch
            );
        }
    }
    let _ = writeln!(
        o,
        "accumulation {} = ⌈global {} / ({gpus} GPU(s) × micro-batch {})⌉",
        a.accumulation, a.global_batch, a.micro_batch
    );
}

#[cfg(test)]
mod tests {
    use super::super::estimate::estimate;
    use super::super::recommend::{recommend, Budget};
    use super::*;

    fn inputs() -> (Transformer, Setup) {
        use crate::planner::estimate::fixtures::{cuda_fp32_adamw, gpt2_small};
        (gpt2_small(), cuda_fp32_adamw())
    }

    /// GPT-2 small on an a100-40, micro-batch 16 × 30: the report both tests read.
    fn with_sample_report<R>(f: impl FnOnce(&Report) -> R) -> R {
        with_report_for(inputs().1, f)
    }

    fn with_report_for<R>(s: Setup, f: impl FnOnce(&Report) -> R) -> R {
        let m = inputs().0;
        let e = estimate(&m, &s, 16, 30);
        let g = GpuTarget {
            name: "a100-40".into(),
            capacity_bytes: 40 << 30,
            total_bytes: None,
            free_bytes: None,
            source: "preset".into(),
            note: None,
        };
        let rec = recommend(&m, &s, Some(480), Budget { capacity: g.capacity_bytes, margin: 0.85 });
        let r = Report {
            schema: SCHEMA,
            source: "x.yaml",
            model: &m,
            params: m.params(),
            setup: &s,
            global_batch: Some(480),
            gpus: 1,
            micro_batch: 16,
            accumulation: Some(30),
            estimate: &e,
            gpu: Some(&g),
            recommendation: Some(&rec),
            levels: None,
            profile: None,
            applied: None,
        };
        f(&r)
    }

    #[test]
    fn json_has_the_documented_fields_and_consistent_sums() {
        let j: serde_json::Value =
            with_sample_report(|r| serde_json::from_str(&serde_json::to_string(r).unwrap()).unwrap());
        assert_eq!(j["schema"], 1);
        assert_eq!(j["params"], 124_439_808u64 + 47 * 768, "the vocabulary padded to 50304 rows");
        assert_eq!(j["setup"]["precision"], "fp32");
        assert_eq!(j["setup"]["optimizer"], "adamw");
        let est = &j["estimate"];
        let part = |k: &str| est[k].as_u64().unwrap_or_else(|| panic!("estimate.{k} missing"));
        let sum = part("weights")
            + part("master_weights")
            + part("gradients")
            + part("optimizer")
            + part("buffers")
            + part("activations")
            + part("logits")
            + part("cross_entropy")
            + part("dp_buffers");
        assert_eq!(sum, part("peak_allocated"), "accumulating: every part is held at once");
        assert_eq!(part("peak_allocated") + part("fragmentation") + part("cuda_overhead"), part("total"));
        let rj = &j["recommendation"];
        assert_eq!(rj["fits"], true);
        let (b, k) = (rj["micro_batch"].as_u64().unwrap(), rj["accumulation"].as_u64().unwrap());
        assert_eq!(480u64.div_ceil(b), k, "the last micro-batch takes the remainder");
        assert!(rj["total_bytes"].as_u64().unwrap() <= rj["budget_bytes"].as_u64().unwrap());
        assert!(j["profile"].is_null() && j["applied"].is_null());
    }

    #[test]
    fn table_lists_every_part_and_the_recommendation() {
        let (text, total) = with_sample_report(|r| (render(r), r.estimate.total));
        for row in [
            "weights (fp32)",
            "fp32 master weights",
            "gradients",
            "optimizer state (adamw)",
            "activations:",
            "logits",
            "cross-entropy",
            "fragmentation",
            "CUDA context",
            "= total per GPU",
            "fixed",
            "per sample",
            "fits      micro-batch",
        ] {
            assert!(text.contains(row), "`{row}` missing:\n{text}");
        }
        assert!(text.contains(&format!("{:.3}", total as f64 / GIB)), "{text}");
    }

    /// `first_n:4`: the activations row multiplies by the blocks that keep theirs, not by one.
    #[test]
    fn checkpointing_the_first_blocks_counts_the_blocks_that_keep_their_activations() {
        let (m, s) = inputs();
        let s = Setup { activation_checkpointing: true, checkpoint_first: Some(4), ..s };
        let text = with_report_for(s, render);
        assert!(text.contains(&format!("/layer × {} + ", m.layers - 4)), "{text}");
        assert!(text.contains(&format!("on (the first 4 of {} blocks)", m.layers)), "{text}");
    }
}
