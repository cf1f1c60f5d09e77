//! torchelastic's error file: on a fatal error a worker writes it so that `torchrun` prints
//! the real cause instead of "exitcode 1".
use std::path::Path;

/// `{"message": {"message": "<kind>: <text>", "extraInfo": {"py_callstack": …, "timestamp": …}}}`.
pub fn write_error_file(path: &Path, kind: &str, text: &str) -> std::io::Result<()> {
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let json = serde_json::json!({
        "message": {
            "message": format!("{kind}: {text}"),
            "extraInfo": {"py_callstack": format!("(trainguard, a Rust binary: no Python stack)\n{text}"), "timestamp": now.to_string()}
        }
    });
    std::fs::write(path, serde_json::to_string(&json).expect("JSON"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torchelastic_format() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("err.json");
        write_error_file(&p, "OutOfMemory", "out of memory at micro-batch 1").unwrap();
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        assert_eq!(v["message"]["message"], "OutOfMemory: out of memory at micro-batch 1");
        assert!(v["message"]["extraInfo"]["timestamp"].as_str().unwrap().parse::<u64>().is_ok());
    }
}
