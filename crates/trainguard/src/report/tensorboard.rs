//! TensorBoard event files (`out_dir/tb/events.out.tfevents.*`): a sink beside metrics.jsonl that
//! `events::Reporter` feeds when `metrics.tensorboard: true`. Every numeric field of a step's
//! metrics becomes a scalar under its metrics.jsonl name, the resolved config is a text summary
//! (`config`, step 0) and every other event is a text summary (`events`) at its step.
//!
//! No maintained Rust crate writes this format (tensorboard-rs was last released in 2022 on
//! protobuf 2 and image 0.23), so the few messages needed are declared here with `prost`'s derive
//! and framed as TensorFlow's TFRecord: length (u64 LE), masked CRC-32C of the length, the
//! bytes, masked CRC-32C of the bytes (`crc32c` crate).
use prost::Message;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

// The subset of tensorflow/core/util/event.proto and framework/{summary,tensor}.proto in use,
// with the same field numbers.
#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
    #[prost(message, optional, tag = "7")]
    session_log: Option<SessionLog>,
}

/// A session's start: TensorBoard drops what earlier files hold at this step and after it, as
/// for PyTorch's `SummaryWriter(purge_step=)`.
#[derive(Clone, PartialEq, Message)]
struct SessionLog {
    /// 1 = START.
    #[prost(int32, tag = "1")]
    status: i32,
}

const SESSION_START: i32 = 1;

#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
    #[prost(message, optional, tag = "8")]
    tensor: Option<TensorProto>,
    #[prost(message, optional, tag = "9")]
    metadata: Option<SummaryMetadata>,
}

#[derive(Clone, PartialEq, Message)]
struct SummaryMetadata {
    #[prost(message, optional, tag = "1")]
    plugin_data: Option<PluginData>,
}

#[derive(Clone, PartialEq, Message)]
struct PluginData {
    #[prost(string, tag = "1")]
    plugin_name: String,
}

#[derive(Clone, PartialEq, Message)]
struct TensorProto {
    /// 7 = DT_STRING.
    #[prost(int32, tag = "1")]
    dtype: i32,
    /// An empty shape: a scalar string.
    #[prost(message, optional, tag = "2")]
    tensor_shape: Option<TensorShape>,
    #[prost(bytes = "vec", repeated, tag = "8")]
    string_val: Vec<Vec<u8>>,
}

#[derive(Clone, PartialEq, Message)]
struct TensorShape {}

const DT_STRING: i32 = 7;

/// One event file, opened for the life of the run. A resumed run starts a new file; TensorBoard
/// reads every file in the directory in name order, and each file's session start drops the
/// steps a resume replays (or, at step 0, a previous run's) from the files before it.
pub struct TensorBoardWriter {
    out: BufWriter<File>,
    path: PathBuf,
    last_step: i64,
}

impl TensorBoardWriter {
    /// Creates `dir/events.out.tfevents.<time>.<µs>.<host>.<pid>.trainguard` (the microseconds
    /// order two sessions begun within a second) and writes the file-version record and the
    /// session's start at `start_step`.
    pub fn create(dir: &Path, start_step: u64) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{:06}.{host}.{}.trainguard",
            now.as_secs(),
            now.subsec_micros(),
            std::process::id()
        );
        let path = dir.join(name);
        let step = start_step as i64;
        let mut w = Self { out: BufWriter::new(File::create(&path)?), path, last_step: step };
        w.write(Event {
            wall_time: now.as_secs_f64(),
            step,
            file_version: Some("brain.Event:2".into()),
            ..Default::default()
        })?;
        w.write(Event {
            wall_time: now.as_secs_f64(),
            step,
            session_log: Some(SessionLog { status: SESSION_START }),
            ..Default::default()
        })?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every numeric field of a metrics.jsonl line (except `step`) as a scalar at its step;
    /// `null`s are left out.
    pub fn scalars(&mut self, line: &serde_json::Value) -> std::io::Result<()> {
        let Some(step) = line["step"].as_i64() else { return Ok(()) };
        let Some(fields) = line.as_object() else { return Ok(()) };
        let value = fields
            .iter()
            .filter(|(k, _)| k.as_str() != "step")
            .filter_map(|(k, v)| {
                v.as_f64().map(|x| SummaryValue {
                    tag: k.clone(),
                    simple_value: Some(x as f32),
                    tensor: None,
                    metadata: None,
                })
            })
            .collect();
        self.last_step = step;
        self.summary(step, Summary { value })
    }

    /// A text summary (TensorBoard's Text tab renders it as Markdown) at `step`, or at the last
    /// metrics step when the event has none.
    pub fn text(&mut self, tag: &str, step: Option<i64>, text: &str) -> std::io::Result<()> {
        let value = SummaryValue {
            tag: tag.into(),
            simple_value: None,
            tensor: Some(TensorProto {
                dtype: DT_STRING,
                tensor_shape: Some(TensorShape {}),
                string_val: vec![text.as_bytes().to_vec()],
            }),
            metadata: Some(SummaryMetadata { plugin_data: Some(PluginData { plugin_name: "text".into() }) }),
        };
        self.summary(step.unwrap_or(self.last_step), Summary { value: vec![value] })
    }

    fn summary(&mut self, step: i64, summary: Summary) -> std::io::Result<()> {
        let wall_time = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64();
        self.write(Event { wall_time, step, summary: Some(summary), ..Default::default() })
    }

    /// One TFRecord, flushed so a killed run keeps what it wrote (as metrics.jsonl does).
    fn write(&mut self, event: Event) -> std::io::Result<()> {
        self.out.write_all(&record(&event.encode_to_vec()))?;
        self.out.flush()
    }
}

/// TFRecord framing of one serialized message.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// TensorFlow's CRC mask: CRC-32C rotated right by 15 bits plus a constant, so that CRCs of data
/// that contains CRCs stay well distributed.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::manual_rotate)] // written as TensorFlow's crc32c.h writes Mask()
    fn crc32c_and_mask_match_known_values() {
        // CRC-32C of "123456789" is 0xE3069283 (the standard check value).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        let crc: u32 = 0xE306_9283;
        assert_eq!(masked_crc(b"123456789"), ((crc >> 15) | (crc << 17)).wrapping_add(0xa282_ead8));
    }

    #[test]
    fn record_frames_length_data_and_crcs() {
        let r = record(b"abc");
        assert_eq!(r.len(), 8 + 4 + 3 + 4);
        assert_eq!(u64::from_le_bytes(r[0..8].try_into().unwrap()), 3);
        assert_eq!(u32::from_le_bytes(r[8..12].try_into().unwrap()), masked_crc(&3u64.to_le_bytes()));
        assert_eq!(&r[12..15], b"abc");
        assert_eq!(u32::from_le_bytes(r[15..19].try_into().unwrap()), masked_crc(b"abc"));
    }

    #[test]
    fn scalar_event_decodes_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = TensorBoardWriter::create(dir.path(), 0).unwrap();
        w.scalars(&serde_json::json!({"step": 7, "loss": 2.5, "val_loss": null, "micro_batch": 4})).unwrap();
        let bytes = std::fs::read(w.path()).unwrap();
        let mut events = vec![];
        let mut at = 0;
        while at < bytes.len() {
            let n = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            events.push(Event::decode(&bytes[at + 12..at + 12 + n]).unwrap());
            at += 16 + n;
        }
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        assert_eq!(
            (events[1].step, events[1].session_log.as_ref().map(|l| l.status)),
            (0, Some(SESSION_START))
        );
        let s = events[2].summary.as_ref().unwrap();
        assert_eq!(events[2].step, 7);
        let tags: Vec<(&str, Option<f32>)> =
            s.value.iter().map(|v| (v.tag.as_str(), v.simple_value)).collect();
        assert_eq!(tags, vec![("loss", Some(2.5)), ("micro_batch", Some(4.0))]);
    }
}
