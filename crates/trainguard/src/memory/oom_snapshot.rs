//! `memory.snapshot_on_oom`: the CUDA caching allocator's own history recorder (the one behind
//! `torch.cuda.memory._record_memory_history`), started at run start, and on an out-of-memory
//! `oom_snapshot.pickle` (the file pytorch.org/memory_viz opens) plus `oom_snapshot.txt`, a short
//! summary read from the pickle here: the failed allocation and the largest live blocks. It is
//! taken once the failed attempt has returned, so its tensors are already freed: the live blocks
//! are what outlived the attempt (weights, optimizer state, a leak); what the attempt allocated
//! up to the failure is in the pickle's trace.
//! Rank 0 alone records and writes. On CPU there is no allocator history: a no-op.
use serde_pickle::{DeOptions, HashableValue, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::Device;

/// Alloc/free events kept: enough for several steps of a large model, a few MB of host memory.
pub const MAX_ENTRIES: usize = 100_000;
pub const PICKLE: &str = "oom_snapshot.pickle";
pub const SUMMARY: &str = "oom_snapshot.txt";

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("the allocator snapshot: {0}")]
    Shim(#[from] crate::ffi::ShimError),
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("cannot read the snapshot pickle: {0}")]
    Pickle(String),
}

/// Starts the recorder when asked and possible; true when it is recording. CPU: false, and the
/// guard says so (one log line) when an out-of-memory comes.
pub fn start(enabled: bool, device: Device, writer: bool) -> bool {
    if !enabled || !writer || !device.is_cuda() {
        return false;
    }
    match crate::ffi::record_memory_history(true, MAX_ENTRIES) {
        Ok(()) => {
            tracing::info!(
                "memory.snapshot_on_oom: recording the CUDA allocator's history (last {MAX_ENTRIES} events)"
            );
            true
        }
        Err(e) => {
            tracing::warn!("memory.snapshot_on_oom: cannot record the allocator's history, no snapshot on out-of-memory: {e}");
            false
        }
    }
}

/// Writes the pickle and its summary into `dir`; returns the pickle's path.
pub fn write(dir: &Path) -> Result<PathBuf, SnapshotError> {
    let pickle = crate::ffi::memory_snapshot_pickled()?;
    let path = dir.join(PICKLE);
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| SnapshotError::Write { path, source }
    };
    std::fs::write(&path, &pickle).map_err(io(&path))?;
    let summary = Summary::read(&pickle)?.text();
    let txt = dir.join(SUMMARY);
    std::fs::write(&txt, summary).map_err(io(&txt))?;
    Ok(path)
}

/// What `oom_snapshot.txt` says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    pub segments: usize,
    pub reserved_bytes: u64,
    pub allocated_bytes: u64,
    /// Live blocks (`active_allocated`): (size, address), largest first.
    pub largest: Vec<(u64, u64)>,
    pub live_blocks: usize,
    /// The allocations that failed (trace entries `oom`): (size, device free bytes).
    pub failed: Vec<(u64, u64)>,
}

const SHOWN: usize = 10;

impl Summary {
    /// Reads the snapshot's `segments` (each with `blocks`) and `device_traces` (per device, a
    /// list of entries with `action`), the layout `torch.cuda.memory._snapshot()` documents.
    pub fn read(pickle: &[u8]) -> Result<Self, SnapshotError> {
        let v = serde_pickle::value_from_slice(pickle, DeOptions::new().replace_unresolved_globals())
            .map_err(|e| SnapshotError::Pickle(e.to_string()))?;
        let top = dict(&v).ok_or_else(|| SnapshotError::Pickle("not a dict".into()))?;
        let mut s = Summary::default();
        let mut live = Vec::new();
        for seg in list(top.get("segments").copied()) {
            let Some(seg) = dict(seg) else { continue };
            s.segments += 1;
            s.reserved_bytes += int(seg.get("total_size"));
            for block in list(seg.get("blocks").copied()) {
                let Some(b) = dict(block) else { continue };
                if text(b.get("state")) == Some("active_allocated") {
                    live.push((int(b.get("size")), int(b.get("address"))));
                }
            }
        }
        s.allocated_bytes = live.iter().map(|(size, _)| size).sum();
        s.live_blocks = live.len();
        live.sort_by(|a, b| b.cmp(a));
        live.truncate(SHOWN);
        s.largest = live;
        for device in list(top.get("device_traces").copied()) {
            for entry in list(Some(device)) {
                let Some(e) = dict(entry) else { continue };
                if text(e.get("action")) == Some("oom") {
                    s.failed.push((int(e.get("size")), int(e.get("device_free"))));
                }
            }
        }
        Ok(s)
    }

    pub fn text(&self) -> String {
        let mut out = String::from("CUDA caching-allocator snapshot at the out-of-memory (oom_snapshot.pickle: open it at https://pytorch.org/memory_viz)\n");
        match self.failed.last() {
            Some((size, free)) => {
                out += &format!("failed allocation: {} ({} free on the device)\n", human(*size), human(*free))
            }
            None => out += "failed allocation: not in the recorded history\n",
        }
        out += &format!(
            "reserved: {} in {} segments; allocated: {} in {} live blocks\nlargest live blocks:\n",
            human(self.reserved_bytes),
            self.segments,
            human(self.allocated_bytes),
            self.live_blocks
        );
        for (i, (size, addr)) in self.largest.iter().enumerate() {
            out += &format!("{:>3}. {:>11}  at 0x{addr:x}\n", i + 1, human(*size));
        }
        out
    }
}

/// `1.23 GiB`, `45.6 MiB`, or for small blocks `512 B` / `3.5 KiB`.
fn human(bytes: u64) -> String {
    match bytes {
        b if b < 1 << 10 => format!("{b} B"),
        b if b < 1 << 20 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => crate::memory::human(b),
    }
}

fn dict(v: &Value) -> Option<BTreeMap<&str, &Value>> {
    match v {
        Value::Dict(d) => Some(
            d.iter()
                .filter_map(
                    |(k, v)| if let HashableValue::String(k) = k { Some((k.as_str(), v)) } else { None },
                )
                .collect(),
        ),
        _ => None,
    }
}

fn list(v: Option<&Value>) -> &[Value] {
    match v {
        Some(Value::List(l)) | Some(Value::Tuple(l)) => l,
        _ => &[],
    }
}

fn int(v: Option<&&Value>) -> u64 {
    match v {
        Some(Value::I64(i)) => (*i).max(0) as u64,
        Some(Value::Int(i)) => u64::try_from(i.clone()).unwrap_or(u64::MAX),
        _ => 0,
    }
}

fn text<'a>(v: Option<&&'a Value>) -> Option<&'a str> {
    match v {
        Some(Value::String(s)) => Some(s.as_str()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(pairs: Vec<(&str, Value)>) -> Value {
        Value::Dict(pairs.into_iter().map(|(k, v)| (HashableValue::String(k.into()), v)).collect())
    }

    fn block(size: i64, addr: i64, state: &str) -> Value {
        d(vec![
            ("size", Value::I64(size)),
            ("requested_size", Value::I64(size)),
            ("address", Value::I64(addr)),
            ("state", Value::String(state.into())),
            ("frames", Value::List(vec![])),
        ])
    }

    /// The layout of `torch.cuda.memory._snapshot()` (PyTorch's documented Snapshot / Segment /
    /// Block / TraceEntry), pickled as protocol 2 the way the C++ pickler writes it; the real
    /// file from a GPU is checked in tests/it/gpu.rs.
    #[test]
    fn the_summary_names_the_failed_allocation_and_the_largest_live_blocks() {
        let gib = 1i64 << 30;
        let seg1 = d(vec![
            ("address", Value::I64(0x7000_0000_0000)),
            ("total_size", Value::I64(4 * gib)),
            ("segment_type", Value::String("large".into())),
            (
                "blocks",
                Value::List(vec![
                    block(3 * gib, 0x7000_0000_0000, "active_allocated"),
                    block(gib, 0x7000_c000_0000, "inactive"),
                ]),
            ),
        ]);
        let seg2 = d(vec![
            ("total_size", Value::I64(2 << 20)),
            ("blocks", Value::List((0..12).map(|i| block(512 + i, 0x10 + i, "active_allocated")).collect())),
        ]);
        let traces = Value::List(vec![Value::List(vec![
            d(vec![
                ("action", Value::String("alloc".into())),
                ("addr", Value::I64(1)),
                ("size", Value::I64(512)),
            ]),
            d(vec![
                ("action", Value::String("oom".into())),
                ("device_free", Value::I64(gib / 2)),
                ("size", Value::I64(2 * gib)),
            ]),
        ])]);
        let snap = d(vec![("segments", Value::List(vec![seg1, seg2])), ("device_traces", traces)]);
        let bytes = serde_pickle::value_to_vec(&snap, serde_pickle::SerOptions::new().proto_v2()).unwrap();
        let s = Summary::read(&bytes).unwrap();
        assert_eq!(s.failed, [(2 << 30, 1 << 29)]);
        assert_eq!((s.segments, s.live_blocks), (2, 13));
        assert_eq!(s.reserved_bytes, (4 << 30) + (2 << 20));
        assert_eq!(s.largest.len(), SHOWN);
        assert_eq!(s.largest[0], (3 << 30, 0x7000_0000_0000), "the inactive block is not live");
        let text = s.text();
        assert!(text.contains("failed allocation: 2.00 GiB (512.0 MiB free on the device)"), "{text}");
        assert!(text.contains("  1.    3.00 GiB  at 0x700000000000\n  2.       523 B  at 0x1b\n"), "{text}");
        assert!(Summary::read(b"not a pickle").is_err());
    }
}
