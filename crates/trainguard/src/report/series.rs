//! What the report draws, independent of how: the panels and their metrics.jsonl fields, the
//! downsampling that keeps a 100k-step run small without hiding spikes, and the event markers.
//! Pure functions over [`RunData`].
use super::read::RunData;
use serde_json::Value;

pub const GIB: f64 = (1u64 << 30) as f64;

/// (step, elapsed_s, value) points of one metrics field.
pub type Points = Vec<(u64, f64, f64)>;

/// One curve: a metrics.jsonl field, its legend label, and the factor to the panel's unit.
pub struct SeriesDef {
    pub key: &'static str,
    pub label: &'static str,
    pub scale: f64,
}

pub struct PanelDef {
    pub id: &'static str,
    pub title: &'static str,
    pub unit: &'static str,
    pub series: &'static [SeriesDef],
    /// Drawn as a staircase (the value holds until the next point), and thinned to its changes.
    pub steps: bool,
    /// The y axis starts at zero (amounts, not losses).
    pub from_zero: bool,
}

const fn s(key: &'static str, label: &'static str) -> SeriesDef {
    SeriesDef { key, label, scale: 1.0 }
}
const fn gib(key: &'static str, label: &'static str) -> SeriesDef {
    SeriesDef { key, label, scale: 1.0 / GIB }
}

pub const PANELS: &[PanelDef] = &[
    PanelDef {
        id: "loss",
        title: "Loss",
        unit: "nats",
        series: &[s("loss", "train"), s("val_loss", "validation")],
        steps: false,
        from_zero: false,
    },
    // `eval.tasks`: the mean over the tasks (each task's last figures are in the header).
    PanelDef {
        id: "downstream",
        title: "Downstream accuracy",
        unit: "",
        series: &[s("eval_acc", "acc"), s("eval_acc_norm", "acc_norm (per character)")],
        steps: false,
        from_zero: true,
    },
    PanelDef {
        id: "lr",
        title: "Learning rate",
        unit: "",
        series: &[s("lr", "lr")],
        steps: false,
        from_zero: true,
    },
    PanelDef {
        id: "throughput",
        title: "Throughput",
        unit: "tokens/s",
        series: &[s("tokens_per_s", "tokens/s")],
        steps: false,
        from_zero: true,
    },
    PanelDef {
        id: "memory",
        title: "Memory",
        unit: "GiB",
        series: &[
            gib("allocated_bytes", "allocated"),
            gib("reserved_bytes", "reserved"),
            gib("peak_allocated_bytes", "peak allocated"),
            gib("peak_reserved_bytes", "peak reserved"),
            gib("gpu_memory_used_bytes", "device used (NVML)"),
            gib("rss_bytes", "process resident"),
        ],
        steps: false,
        from_zero: true,
    },
    PanelDef {
        id: "batch",
        title: "Micro-batch × accumulation",
        unit: "",
        series: &[s("micro_batch", "micro-batch"), s("accumulation", "accumulation")],
        steps: true,
        from_zero: true,
    },
];

/// Each `eval.tasks` task's last scores: (name, step, acc, acc_norm), by name. The names come
/// from the fields `eval_NAME_acc` (`crate::eval::metrics`).
pub fn downstream_last(run: &RunData) -> Vec<(String, u64, f64, f64)> {
    let mut names = std::collections::BTreeSet::new();
    for m in run.steps.values() {
        for k in m.keys() {
            if let Some(name) = k.strip_prefix("eval_").and_then(|k| k.strip_suffix("_acc")) {
                if !name.is_empty() {
                    names.insert(name.to_string());
                }
            }
        }
    }
    names
        .into_iter()
        .filter_map(|name| {
            let (step, _, acc) = *run.series(&format!("eval_{name}_acc")).last()?;
            let norm = run.series(&format!("eval_{name}_acc_norm")).last().map_or(f64::NAN, |p| p.2);
            Some((name, step, acc, norm))
        })
        .collect()
}

/// Buckets per curve: about one per pixel column of a full-width panel.
pub const BUCKETS: usize = 1000;

/// At most ~2·`buckets` points: per bucket of consecutive points, the lowest and the highest (in
/// their order), plus the first and last point, so a one-step spike is still drawn.
pub fn downsample(points: &[(u64, f64, f64)], buckets: usize) -> Vec<(u64, f64, f64)> {
    if points.len() <= 2 * buckets {
        return points.to_vec();
    }
    let mut keep = vec![false; points.len()];
    keep[0] = true;
    keep[points.len() - 1] = true;
    for b in 0..buckets {
        let (lo, hi) = (b * points.len() / buckets, (b + 1) * points.len() / buckets);
        let chunk = &points[lo..hi];
        let by = |f: fn(f64, f64) -> bool| {
            chunk.iter().enumerate().fold(0, |best, (i, p)| if f(p.2, chunk[best].2) { i } else { best })
        };
        keep[lo + by(|a, b| a < b)] = true;
        keep[lo + by(|a, b| a > b)] = true;
    }
    points.iter().zip(keep).filter(|(_, k)| *k).map(|(p, _)| *p).collect()
}

/// A staircase needs only the points where the value changes (and the last one).
pub fn changes(points: &[(u64, f64, f64)]) -> Vec<(u64, f64, f64)> {
    let mut out: Vec<(u64, f64, f64)> = vec![];
    for (i, p) in points.iter().enumerate() {
        if out.last().is_none_or(|l| l.2 != p.2) || i + 1 == points.len() {
            out.push(*p);
        }
    }
    out
}

/// The points drawn for a field of a run.
pub fn drawn(run: &RunData, key: &str, steps: bool) -> Points {
    let all = run.series(key);
    if steps {
        downsample(&changes(&all), BUCKETS)
    } else {
        downsample(&all, BUCKETS)
    }
}

/// An event drawn on every panel.
#[derive(Debug, Clone, PartialEq)]
pub struct Mark {
    pub kind: String,
    pub step: u64,
    pub label: String,
}

/// Markers for the events that mark a moment in training; events without a step (run start,
/// skipped checkpoints) are in the header instead.
pub fn marks(run: &RunData) -> Vec<Mark> {
    let n = |v: &Value, k: &str| match &v[k] {
        Value::Null => "?".to_string(),
        Value::String(s) => s.clone(),
        x => x.to_string(),
    };
    let mut out = vec![];
    for e in &run.events {
        let kind = e["event"].as_str().unwrap_or_default();
        let step = match kind {
            "run_finished" => e["steps"].as_u64(),
            _ => e["step"].as_u64(),
        };
        let Some(step) = step else { continue };
        let label = match kind {
            "oom_recovered" if e["regrow_backoff"] == true => format!(
                "regrow trial failed: micro-batch {} → {}",
                n(e, "old_micro_batch"),
                n(e, "new_micro_batch")
            ),
            "oom_recovered" => {
                let asked = e["requested_bytes"]
                    .as_f64()
                    .map(|b| format!(" (asked for {:.1} MiB)", b / (1u64 << 20) as f64))
                    .unwrap_or_default();
                format!(
                    "OOM recovered{asked}: micro-batch {} → {}, accumulation {} → {}",
                    n(e, "old_micro_batch"),
                    n(e, "new_micro_batch"),
                    n(e, "old_accumulation"),
                    n(e, "new_accumulation")
                )
            }
            "regrow_attempt" => {
                format!("regrow trial: micro-batch {} → {}", n(e, "from_micro_batch"), n(e, "to_micro_batch"))
            }
            "oom_escalated" => {
                format!("OOM at micro-batch {}: {} switched on", n(e, "micro_batch"), n(e, "switched_on"))
            }
            "checkpoint_saved" => format!("checkpoint {}", n(e, "path")),
            "checkpoint_failed" => format!("checkpoint failed: {}", n(e, "error")),
            "checkpoint_waited" => {
                let waited = e["seconds"].as_f64().map_or("?".into(), |s| format!("{s:.2}s"));
                format!(
                    "waited {waited} for the background write of checkpoint {step} (before the {})",
                    n(e, "before")
                )
            }
            "leak_suspected" => format!("leak suspected: {}", n(e, "message")),
            "thrash_detected" => {
                format!("allocator thrash ({} retries): {}", n(e, "total_retries"), n(e, "action"))
            }
            "nonfinite_skipped" => {
                format!("non-finite loss or gradient: update skipped ({} in a row)", n(e, "consecutive"))
            }
            "graphs_off" => format!("CUDA graphs off: {}", n(e, "reason")),
            "diverged" => format!(
                "diverged (data step {}): {} {} past {}{}",
                n(e, "data_step"),
                n(e, "statistic"),
                n(e, "value"),
                n(e, "limit"),
                if e["gives_up"] == true { "; rollbacks spent" } else { "" }
            ),
            "rolled_back" => format!(
                "rolled back from step {} to {}: data steps {}–{} skipped",
                n(e, "diverged_step"),
                step,
                n(e, "skipped_from"),
                n(e, "skipped_to")
            ),
            "loss_scale_changed" if e["reason"] == "overflow" => {
                format!("fp16 overflow: loss scale {}", n(e, "scale"))
            }
            "resumed" => format!("resumed at step {step} from {}", n(e, "path")),
            "stopped" => format!("stopped: {}", n(e, "reason")),
            "run_finished" => format!("finished after {step} steps"),
            _ => continue,
        };
        out.push(Mark { kind: kind.to_string(), step, label });
    }
    out
}

/// Marker colour by kind: red for out of memory, green for growth, grey for routine.
pub fn mark_color(kind: &str) -> &'static str {
    match kind {
        "oom_recovered" => "#d62728",
        "oom_escalated" => "#7f0000",
        "regrow_attempt" => "#2ca02c",
        "checkpoint_saved" => "#9a9a9a",
        "checkpoint_waited" => "#8c564b",
        "checkpoint_failed" | "nonfinite_skipped" | "graphs_off" => "#ff7f0e",
        "leak_suspected" | "thrash_detected" => "#9467bd",
        "loss_scale_changed" => "#bcbd22",
        "resumed" => "#1f77b4",
        "diverged" => "#e377c2",
        "rolled_back" => "#8c564b",
        _ => "#222222",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pts(values: &[f64]) -> Vec<(u64, f64, f64)> {
        values.iter().enumerate().map(|(i, &v)| (i as u64, i as f64, v)).collect()
    }

    #[test]
    fn downsampling_keeps_spikes_and_ends() {
        let mut v: Vec<f64> = (0..100_000).map(|i| 2.0 + (i as f64 * 0.01).sin() * 0.1).collect();
        v[54_321] = 50.0;
        v[77_777] = -3.0;
        let d = downsample(&pts(&v), 1000);
        assert!(d.len() <= 2002, "{}", d.len());
        assert!(d.iter().any(|p| p.0 == 54_321 && p.2 == 50.0));
        assert!(d.iter().any(|p| p.0 == 77_777 && p.2 == -3.0));
        assert_eq!((d[0].0, d.last().unwrap().0), (0, 99_999));
        assert!(d.windows(2).all(|w| w[0].0 < w[1].0), "order kept");
        // Every drawn point is an original point.
        assert!(d.iter().all(|p| v[p.0 as usize] == p.2));
    }

    #[test]
    fn short_series_are_drawn_whole() {
        let v = pts(&[1.0, 3.0, 2.0]);
        assert_eq!(downsample(&v, 1000), v);
    }

    /// A capture failure that switched the CUDA graphs off is marked with its reason; a routine
    /// capture is not.
    #[test]
    fn graphs_switched_off_are_marked_and_captures_are_not() {
        let events = vec![
            serde_json::json!({"event": "graph_captured", "step": 1, "micro_batch": 16}),
            serde_json::json!({"event": "graphs_off", "step": 3, "reason": "operation not permitted when stream is capturing"}),
        ];
        let m = marks(&RunData { events, ..RunData::default() });
        assert_eq!(m.len(), 1);
        assert_eq!((m[0].kind.as_str(), m[0].step), ("graphs_off", 3));
        assert_eq!(m[0].label, "CUDA graphs off: operation not permitted when stream is capturing");
        assert_eq!(mark_color(&m[0].kind), "#ff7f0e");
    }

    /// A divergence and its rollback are marked: the spike where it happened, the rollback at
    /// the step training went back to, with the data skipped.
    #[test]
    fn divergence_and_rollback_are_marked() {
        let events = vec![
            serde_json::json!({"event": "diverged", "step": 32, "data_step": 32, "statistic": "loss", "value": 9.5, "median": 3.0, "mad": 0.1, "limit": 3.6, "recent": 0, "gives_up": false}),
            serde_json::json!({"event": "rolled_back", "step": 30, "diverged_step": 32, "checkpoint": "c", "skipped_from": 31, "skipped_to": 32, "lr_factor": 1.0, "lr_lowered_until": null, "rollbacks": 1}),
        ];
        let m = marks(&RunData { events, ..RunData::default() });
        assert_eq!(
            m.iter().map(|m| (m.kind.as_str(), m.step)).collect::<Vec<_>>(),
            vec![("diverged", 32), ("rolled_back", 30)]
        );
        assert_eq!(m[0].label, "diverged (data step 32): loss 9.5 past 3.6");
        assert_eq!(m[1].label, "rolled back from step 32 to 30: data steps 31–32 skipped");
        assert_ne!(mark_color("rolled_back"), mark_color("whatever"));
    }

    /// Training held up by a background checkpoint write is marked, with how long and why.
    #[test]
    fn waits_for_a_background_checkpoint_are_marked() {
        let events = vec![
            serde_json::json!({"event": "checkpoint_saved", "step": 4, "path": "c/step-00000004", "seconds": 2.0, "deleted": []}),
            serde_json::json!({"event": "checkpoint_waited", "step": 4, "seconds": 1.25, "before": "next checkpoint"}),
        ];
        let m = marks(&RunData { events, ..RunData::default() });
        assert_eq!(m.len(), 2);
        assert_eq!((m[1].kind.as_str(), m[1].step), ("checkpoint_waited", 4));
        assert_eq!(
            m[1].label,
            "waited 1.25s for the background write of checkpoint 4 (before the next checkpoint)"
        );
        assert_eq!(mark_color(&m[1].kind), "#8c564b");
    }

    #[test]
    fn staircase_keeps_changes_and_last() {
        let c = changes(&pts(&[8.0, 8.0, 4.0, 4.0, 4.0, 8.0, 8.0]));
        assert_eq!(
            c.iter().map(|p| (p.0, p.2)).collect::<Vec<_>>(),
            vec![(0, 8.0), (2, 4.0), (5, 8.0), (6, 8.0)]
        );
    }
}
