//! Token shards on disk and the `dataset.json` manifest `trainguard prepare` writes. Owns the
//! byte layout (llm.c's: a header of 256 little-endian int32 — magic, version, token count —
//! then the tokens; uint16 is llm.c's GPT-2 format, magic 20240520 version 1, uint32 its
//! Llama-3 format, magic 20240801 version 7), telling a headed shard from a flat nanoGPT
//! `train.bin`, and which files a `tokens:<path>` source names. It does not read tokens for
//! training (that is `corpus`) nor tokenize (that is `prepare`).
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const HEADER_INTS: usize = 256;
pub const HEADER_BYTES: usize = HEADER_INTS * 4;
pub const MANIFEST_FILE: &str = "dataset.json";
pub const MANIFEST_FORMAT: &str = "trainguard-dataset/1";

/// Width of one token on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Uint16,
    Uint32,
}

impl Dtype {
    /// The narrowest width that holds every id of a vocabulary of `vocab` tokens.
    pub fn for_vocab(vocab: usize) -> Self {
        if vocab <= 1 << 16 {
            Dtype::Uint16
        } else {
            Dtype::Uint32
        }
    }

    pub fn width(self) -> usize {
        match self {
            Dtype::Uint16 => 2,
            Dtype::Uint32 => 4,
        }
    }

    /// llm.c's (magic, version) for this width.
    pub fn magic_version(self) -> (i32, i32) {
        match self {
            Dtype::Uint16 => (20240520, 1),
            Dtype::Uint32 => (20240801, 7),
        }
    }
}

/// The 1024-byte header of a shard of `tokens` tokens of width `dtype`.
pub fn header(dtype: Dtype, tokens: usize) -> Vec<u8> {
    let (magic, version) = dtype.magic_version();
    let mut ints = [0i32; HEADER_INTS];
    ints[0] = magic;
    ints[1] = version;
    ints[2] = tokens as i32;
    ints.iter().flat_map(|i| i.to_le_bytes()).collect()
}

/// Where the tokens of a file start, how many there are and how wide they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub offset: usize,
    pub tokens: usize,
    pub dtype: Dtype,
}

/// Reads the layout from the file's first bytes and its size: an llm.c header when the magic
/// matches (the size must then agree with its token count), else a flat uint16 file.
pub fn layout(head: &[u8], size: u64) -> Result<Layout, String> {
    let int = |i: usize| head.get(4 * i..4 * i + 4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    for dtype in [Dtype::Uint16, Dtype::Uint32] {
        let (magic, version) = dtype.magic_version();
        if int(0) != Some(magic) {
            continue;
        }
        if int(1) != Some(version) {
            return Err(format!(
                "llm.c header with magic {magic} but version {:?}, expected {version}",
                int(1).unwrap_or(0)
            ));
        }
        let tokens = int(2).unwrap_or(-1);
        if tokens < 0 {
            return Err(format!("llm.c header says {tokens} tokens: not a count (a corrupt header?)"));
        }
        let expect = HEADER_BYTES as u64 + tokens as u64 * dtype.width() as u64;
        if size != expect {
            let why = if size < expect {
                "truncated?"
            } else {
                "longer than its header says: appended to, or the count wrong?"
            };
            return Err(format!(
                "header says {tokens} tokens ({expect} bytes) but the file has {size} bytes ({why})"
            ));
        }
        return Ok(Layout { offset: HEADER_BYTES, tokens: tokens as usize, dtype });
    }
    if let Some(why) = corrupt_magic(head, size) {
        return Err(why);
    }
    if looks_like_text(head) {
        return Err("reads as text, not token ids (its first bytes are printable characters, which as uint16 would be ids 8224-32382 only): \
                    `text:FILE` trains on a text file, `trainguard prepare` tokenizes one, and a prepare directory is given as the directory, not its dataset.json"
            .into());
    }
    if !size.is_multiple_of(2) {
        return Err(format!("{size} bytes is not a whole number of uint16 tokens (and no llm.c header)"));
    }
    Ok(Layout { offset: 0, tokens: (size / 2) as usize, dtype: Dtype::Uint16 })
}

/// Whether a flat file's first bytes are text (printable ASCII and line ends, 64 bytes at least):
/// as uint16 every id would then lie in 0x2020-0x7e7e, which token data does not do for long
/// (GPT-2's most common ids are below 8192, and their high bytes below 0x20).
fn looks_like_text(head: &[u8]) -> bool {
    head.len() >= 64
        && head.iter().all(|&b| b == b'\n' || b == b'\r' || b == b'\t' || (0x20..0x7f).contains(&b))
}

/// A header whose every field but the magic is llm.c's (its version, the token count the size
/// gives, the rest zeros): a shard whose magic was damaged, which read as a flat file would put
/// its header into training as 512 tokens. A flat file's first 1024 bytes are tokens, and that
/// many tokens in that pattern do not happen in text.
fn corrupt_magic(head: &[u8], size: u64) -> Option<String> {
    let ints: Vec<i32> = head
        .get(..HEADER_BYTES)?
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let rest_zero = ints[3..].iter().all(|&i| i == 0);
    [Dtype::Uint16, Dtype::Uint32].into_iter().find_map(|dtype| {
        let (magic, version) = dtype.magic_version();
        let count_fits = ints[2] >= 0 && size == HEADER_BYTES as u64 + ints[2] as u64 * dtype.width() as u64;
        (ints[1] == version && count_fits && rest_zero && ints[0] != magic).then(|| {
            format!("an llm.c header with magic {}, where {dtype:?} shards have {magic} (version {version} and {} tokens, as its size says): a damaged shard; rewrite it or leave it out", ints[0], ints[2])
        })
    })
}

/// One shard in the manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardEntry {
    pub file: String,
    pub tokens: u64,
}

/// `DIR/dataset.json`: what `trainguard prepare` wrote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    /// The tokenizer copied next to the shards.
    pub tokenizer: String,
    /// One past the largest token id the tokenizer can produce (added tokens included).
    pub vocab_size: usize,
    pub eos_id: u32,
    pub eos_token: String,
    pub dtype: Dtype,
    pub header_magic: i32,
    pub header_version: i32,
    pub train: Vec<ShardEntry>,
    pub val: Vec<ShardEntry>,
    pub train_tokens: u64,
    pub val_tokens: u64,
    pub documents: u64,
    pub input_bytes: u64,
    pub inputs: Vec<String>,
}

/// CRC-32C of the tokenizer.json a `prepare` directory's manifest names, when it can be read:
/// what a run records of its tokenizer, and what `sample`/`export` compare with.
pub fn tokenizer_checksum(dir: &Path, manifest: &Manifest) -> Option<u32> {
    crate::fs::whole_file::read_regular(&dir.join(&manifest.tokenizer))
        .ok()
        .map(|bytes| crc32c::crc32c(&bytes))
}

/// Where the shards of a `tokens:<path>` source are, and which hold validation tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Sources {
    pub train: Vec<PathBuf>,
    /// Empty: the validation split is the tail of the training shards (`data.val_fraction`).
    pub val: Vec<PathBuf>,
    pub manifest: Option<Manifest>,
}

/// Resolves `path`: a `prepare` directory (its `dataset.json`), a directory of `.bin` shards, a
/// glob (`.bin` files), or one file. Outside a manifest, files named as [`is_validation`] says
/// are validation shards (llm.c's naming: `…_val_000000.bin`).
pub fn resolve(path: &str) -> Result<Sources, String> {
    let p = Path::new(path);
    if p.is_dir() {
        let manifest_path = p.join(MANIFEST_FILE);
        if manifest_path.is_file() {
            let text = crate::fs::whole_file::read_regular_string(&manifest_path)
                .map_err(|e| format!("{}: {e}", manifest_path.display()))?;
            let m: Manifest =
                serde_json::from_str(&text).map_err(|e| format!("{}: {e}", manifest_path.display()))?;
            if m.format != MANIFEST_FORMAT {
                return Err(format!(
                    "{}: format `{}`, expected `{MANIFEST_FORMAT}`",
                    manifest_path.display(),
                    m.format
                ));
            }
            let files = |v: &[ShardEntry]| v.iter().map(|s| p.join(&s.file)).collect::<Vec<_>>();
            return Ok(Sources { train: files(&m.train), val: files(&m.val), manifest: Some(m) });
        }
        let mut bins: Vec<PathBuf> = std::fs::read_dir(p)
            .map_err(|e| format!("{path}: {e}"))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|f| f.is_file() && f.extension().is_some_and(|x| x == "bin"))
            .collect();
        bins.sort();
        return classify(bins, path);
    }
    // A file that exists is that file, whatever its name holds (`run[1].bin`).
    if !p.is_file() && path.contains(['*', '?', '[']) {
        let paths = glob::glob(path).map_err(|e| format!("bad glob `{path}`: {e}"))?;
        // Shards only, as in a directory: `DIR/*` of a prepare directory names its JSON files too.
        let mut files: Vec<PathBuf> = paths
            .filter_map(Result::ok)
            .filter(|f| f.is_file() && f.extension().is_some_and(|x| x == "bin"))
            .collect();
        files.sort();
        return classify(files, path);
    }
    Ok(Sources { train: vec![p.to_path_buf()], val: vec![], manifest: None })
}

fn classify(files: Vec<PathBuf>, what: &str) -> Result<Sources, String> {
    if files.is_empty() {
        return Err(format!("no token shards (.bin) at `{what}`"));
    }
    let (val, train): (Vec<_>, Vec<_>) = files.into_iter().partition(|f| is_validation(f));
    if train.is_empty() {
        return Err(format!(
            "only validation shards (names with a part `val`, `valid` or `validation`) at `{what}`"
        ));
    }
    Ok(Sources { train, val, manifest: None })
}

/// A validation shard's name has `val` (or `valid`, `validation`), a number after it allowed,
/// as one of its parts between `_`, `-` and `.`: llm.c's `fineweb_val_000000.bin`, nanoGPT's
/// `val.bin`, `data_val0.bin`; not `survival_train.bin` or `interval_000.bin`.
fn is_validation(file: &Path) -> bool {
    let stem = file.file_stem().map(|s| s.to_string_lossy().to_lowercase()).unwrap_or_default();
    stem.split(|c: char| !c.is_ascii_alphanumeric()).any(|part| {
        matches!(part.trim_end_matches(|c: char| c.is_ascii_digit()), "val" | "valid" | "validation")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_follow_llm_c_and_flat_files_are_uint16() {
        let h = header(Dtype::Uint16, 5);
        assert_eq!(h.len(), 1024);
        assert_eq!(&h[..12], &[0x88, 0xd8, 0x34, 0x01, 1, 0, 0, 0, 5, 0, 0, 0]); // 20240520 = 0x0134d888
        let l = layout(&h, 1024 + 10).unwrap();
        assert_eq!(l, Layout { offset: 1024, tokens: 5, dtype: Dtype::Uint16 });
        assert!(layout(&h, 1024 + 8).unwrap_err().contains("truncated"));
        assert!(layout(&h, 1024 + 12).unwrap_err().contains("longer than its header says"));
        let mut negative = h.clone();
        negative[8..12].copy_from_slice(&(-5i32).to_le_bytes());
        assert!(layout(&negative, 1024).unwrap_err().contains("says -5 tokens: not a count"));
        let h32 = header(Dtype::Uint32, 3);
        assert_eq!(layout(&h32, 1024 + 12).unwrap().dtype, Dtype::Uint32);
        assert_eq!(i32::from_le_bytes(h32[4..8].try_into().unwrap()), 7);
        // Text given as tokens (a dataset.json, a .txt): refused; token ids that happen to be
        // printable for a few bytes are tokens.
        let json = br#"{"format": "trainguard-dataset/1", "tokenizer": "tokenizer.json", "vocab_size": 424}"#
            .repeat(4);
        assert!(layout(&json, json.len() as u64).unwrap_err().starts_with("reads as text, not token ids"));
        let text = b"Once upon a time there was a cat.\nIt sat on the mat, and then it ran.\r\n".repeat(20);
        assert!(layout(&text[..1024], text.len() as u64).is_err());
        let ids: Vec<u8> =
            [8224u16, 30000, 464, 3797].iter().cycle().take(512).flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(layout(&ids, 1024).unwrap().tokens, 512, "one id below 8192 and it is tokens");
        assert_eq!(layout(b"  ab  ", 6).unwrap().tokens, 3, "a few printable bytes are tokens");
        // No magic: nanoGPT's flat uint16 file.
        assert_eq!(layout(&[1, 0, 2, 0], 4).unwrap(), Layout { offset: 0, tokens: 2, dtype: Dtype::Uint16 });
        assert!(layout(&[1, 0, 2], 3).is_err());
        // Every field llm.c's but the magic: a damaged shard, not 512 tokens of a flat file.
        let mut damaged = header(Dtype::Uint16, 5);
        damaged[..4].copy_from_slice(&12345i32.to_le_bytes());
        let why = layout(&damaged, 1024 + 10).unwrap_err();
        assert!(
            why.starts_with(
                "an llm.c header with magic 12345, where Uint16 shards have 20240520 (version 1 and 5 tokens"
            ),
            "{why}"
        );
        let mut damaged32 = header(Dtype::Uint32, 3);
        damaged32[3] ^= 0x40;
        assert!(layout(&damaged32, 1024 + 12).unwrap_err().contains("where Uint32 shards have 20240801"));
        // A flat file that only starts alike (its size another count, a token past the third
        // int) is tokens.
        assert_eq!(layout(&damaged, 1024 + 12).unwrap().offset, 0);
        damaged[100] = 7;
        assert_eq!(layout(&damaged, 1024 + 10).unwrap().tokens, 517);
        assert_eq!(Dtype::for_vocab(65536), Dtype::Uint16);
        assert_eq!(Dtype::for_vocab(65537), Dtype::Uint32);
    }

    #[test]
    fn directories_and_globs_split_val_shards_by_name() {
        let d = tempfile::tempdir().unwrap();
        for n in ["a_train_000001.bin", "a_train_000000.bin", "a_val_000000.bin", "notes.txt"] {
            std::fs::write(d.path().join(n), [0u8, 0]).unwrap();
        }
        let s = resolve(d.path().to_str().unwrap()).unwrap();
        let names = |v: &[PathBuf]| {
            v.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect::<Vec<_>>()
        };
        assert_eq!(names(&s.train), ["a_train_000000.bin", "a_train_000001.bin"]);
        assert_eq!(names(&s.val), ["a_val_000000.bin"]);
        let g = resolve(&format!("{}/a_train_*.bin", d.path().display())).unwrap();
        assert_eq!(names(&g.train), ["a_train_000000.bin", "a_train_000001.bin"]);
        assert!(g.val.is_empty());
        assert!(resolve(&format!("{}/zzz*.bin", d.path().display())).is_err());
        // A glob takes shards only; an existing file is itself even with glob characters.
        std::fs::write(d.path().join("dataset.json"), "{}").unwrap();
        assert_eq!(
            names(&resolve(&format!("{}/*", d.path().display())).unwrap().train),
            ["a_train_000000.bin", "a_train_000001.bin"]
        );
        std::fs::write(d.path().join("run[1].bin"), [0u8, 0]).unwrap();
        assert_eq!(
            names(&resolve(&format!("{}/run[1].bin", d.path().display())).unwrap().train),
            ["run[1].bin"]
        );
    }

    #[test]
    fn validation_shards_are_named_by_a_part_of_their_name() {
        for (name, val) in [
            ("fineweb_val_000000.bin", true),
            ("val.bin", true),
            ("tiny-valid.bin", true),
            ("x.validation.bin", true),
            ("survival_val_000000.bin", true),
            ("data_val0.bin", true),
            ("val1.bin", true),
            ("survival_train_000000.bin", false),
            ("interval_000.bin", false),
            ("eval_set.bin", false),
            ("train.bin", false),
        ] {
            assert_eq!(is_validation(Path::new(name)), val, "{name}");
        }
    }
}
