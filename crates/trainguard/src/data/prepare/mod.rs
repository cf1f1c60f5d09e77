//! `trainguard prepare`: text (`.txt`, `.jsonl`) → token shards with a Hugging Face
//! `tokenizer.json`. Owns the command: reading documents in chunks (a long one cut into pieces,
//! so the tokenizer's memory is bounded whatever the text), tokenizing the chunks in parallel
//! (rayon) and writing them in input order, EOS after every document, publishing
//! (everything is written under `DIR/.prepare-tmp-*` and moved into place only when the whole
//! corpus is done, `dataset.json` last) and the progress display. The output directory itself
//! (created, locked, checked, its staging directory, undone on failure) is `out_dir`'s; the
//! shard layout and manifest are `data::shards`'.
mod inputs;
mod out_dir;
mod writer;

use crate::data::shards::{self, Dtype, Manifest};
use crate::job::interrupt::Interrupter;
use clap::Args;
use rayon::prelude::*;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;
use tokenizers::{NormalizedString, Normalizer, Tokenizer};

#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// A Hugging Face `tokenizer.json`.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: PathBuf,
    /// Output directory (created with its parents; refused when it already holds a dataset,
    /// a `tokenizer.json` other than --tokenizer, or another prepare is writing it).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// `.txt` files (one document per blank-line-separated block), `.jsonl` files (one per
    /// line), directories (searched recursively) or globs.
    #[arg(required = true, value_name = "INPUT")]
    pub inputs: Vec<String>,
    /// The JSONL field that holds the text.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Tokens per training shard.
    #[arg(long, default_value_t = 100_000_000)]
    pub shard_tokens: usize,
    /// Tokens held out in `val_000000.bin` (the first ones of the corpus); 0: no validation
    /// shard, training then holds out `data.val_fraction` of the training shards' tail.
    #[arg(long, default_value_t = 0)]
    pub val_tokens: usize,
    /// The end-of-document token; default: the first of <|endoftext|>, </s>, <|end_of_text|>,
    /// <eos>, <|eos|> the tokenizer knows.
    #[arg(long, value_name = "TOKEN")]
    pub eos: Option<String>,
    /// Worker threads; default: one per core.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=crate::config::limits::MAX_THREADS as u64))]
    pub threads: Option<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// Bad input: a file, a line, the tokenizer, a flag (exit 2).
    #[error("{0}")]
    Input(String),
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    /// Another `prepare` holds `--out`'s lock (exit 2): the one finishing last would rename
    /// its dataset over the other's.
    #[error("{}: another prepare is writing this directory ({}); two into one directory would replace each other's dataset: wait for it to end, or choose another --out", .dir.display(), .holder.as_deref().unwrap_or("its pid unknown"))]
    Busy { dir: PathBuf, holder: Option<String> },
    /// `--out`'s lock file cannot be opened or locked (exit 1).
    #[error(transparent)]
    Lock(crate::fs::dir_lock::LockError),
    /// SIGINT/SIGTERM: what was written is removed (exit 4, as an interrupted run).
    #[error("interrupted: nothing was kept (what was written so far is removed); run it again")]
    Interrupted,
}

impl PrepareError {
    pub fn input(path: &Path, line: Option<usize>, message: &str) -> Self {
        match line {
            Some(l) => PrepareError::Input(format!("{}:{l}: {message}", path.display())),
            None => PrepareError::Input(format!("{}: {message}", path.display())),
        }
    }
}

/// Whether `cause` is a `prepare` error the user's input caused (exit 2).
pub fn is_usage(cause: &(dyn std::error::Error + 'static)) -> bool {
    matches!(cause.downcast_ref::<PrepareError>(), Some(PrepareError::Input(_) | PrepareError::Busy { .. }))
}

const EOS_CANDIDATES: [&str; 5] = ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>"];
/// Text per work item: large enough to amortise scheduling, small enough that a window of
/// them in flight stays a few tens of MB.
const CHUNK_BYTES: usize = 1 << 20;

/// A loaded tokenizer with the facts `prepare` and `sample` need.
pub struct Vocab {
    pub tokenizer: Tokenizer,
    pub size: usize,
    pub eos_id: u32,
    pub eos: String,
}

pub fn load_tokenizer(path: &Path, eos: Option<&str>) -> Result<Vocab, PrepareError> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        let why = match e.kind() {
            std::io::ErrorKind::NotFound => "tokenizer file not found".to_string(),
            std::io::ErrorKind::InvalidData => "not a tokenizer.json: not UTF-8 text".to_string(),
            _ => format!("cannot read the tokenizer: {e}"),
        };
        PrepareError::input(path, None, &why)
    })?;
    let tokenizer = text
        .parse::<Tokenizer>()
        .map_err(|e| PrepareError::input(path, None, &not_a_tokenizer(&text, &e.to_string())))?;
    let size = tokenizer.get_vocab(true).values().max().map_or(0, |&m| m as usize + 1);
    // A model could not be configured for it (model.vocab_size's bound): said here, not after
    // the whole corpus is tokenized.
    let most = crate::config::limits::MAX_VOCAB;
    if size > most {
        return Err(PrepareError::input(
            path,
            None,
            &format!(
                "a token id of {} is beyond the largest vocabulary a model takes ({most} tokens)",
                size - 1
            ),
        ));
    }
    let (eos, eos_id) = match eos {
        Some(t) => (
            t.to_string(),
            tokenizer.token_to_id(t).ok_or_else(|| {
                PrepareError::input(path, None, &format!("--eos `{t}` is not in the vocabulary"))
            })?,
        ),
        None => EOS_CANDIDATES
            .iter()
            .find_map(|t| tokenizer.token_to_id(t).map(|id| (t.to_string(), id)))
            .ok_or_else(|| {
                PrepareError::input(
                    path,
                    None,
                    &format!("no end-of-document token among {EOS_CANDIDATES:?}; name one with --eos"),
                )
            })?,
    };
    Ok(Vocab { tokenizer, size, eos_id, eos })
}

/// Top-level keys `tokenizers` reads; it fails on any other with a message about the JSON
/// syntax (`expected `,` or `}``) where the file has none.
const TOKENIZER_KEYS: [&str; 9] = [
    "version",
    "truncation",
    "padding",
    "added_tokens",
    "normalizer",
    "pre_tokenizer",
    "model",
    "decoder",
    "post_processor",
];

/// Why `text` does not load as a tokenizer (`error`: the `tokenizers` crate's), said as what
/// the file is: the crate's own message for a JSON file without `model` or with a key it does
/// not know is a syntax error at a place where the syntax is fine.
fn not_a_tokenizer(text: &str, error: &str) -> String {
    let value: serde_json::Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return format!("not a tokenizer.json: not JSON ({e})"),
    };
    let Some(object) = value.as_object() else {
        return "is JSON but not a tokenizer.json: not an object".into();
    };
    let unknown: Vec<String> =
        object.keys().filter(|k| !TOKENIZER_KEYS.contains(&k.as_str())).map(|k| format!("`{k}`")).collect();
    if !object.contains_key("model") {
        let keys =
            if unknown.is_empty() { String::new() } else { format!(" (its keys: {})", unknown.join(", ")) };
        return format!("is JSON but not a tokenizer.json: it has no `model`{keys}; a Hugging Face tokenizer.json holds `model`, `added_tokens`, `pre_tokenizer`, … (tokenizer_config.json and vocab.json are not one)");
    }
    if !unknown.is_empty() {
        return format!("not a tokenizer.json the tokenizers library reads: top-level {} it does not know (it reads only {}); remove them", unknown.join(", "), TOKENIZER_KEYS.join(", "));
    }
    format!("not a valid tokenizer.json: {error}")
}

/// Runs the command; on any error, and when `stop` is requested (a signal), the staging
/// directory is removed.
pub fn run(args: &PrepareArgs, stop: &Interrupter) -> Result<Manifest, PrepareError> {
    if args.shard_tokens == 0 || args.shard_tokens >= i32::MAX as usize {
        return Err(PrepareError::Input(format!(
            "--shard-tokens must be between 1 and {} (llm.c's int32 count)",
            i32::MAX - 1
        )));
    }
    if args.val_tokens >= i32::MAX as usize {
        return Err(PrepareError::Input(format!("--val-tokens must be below {}", i32::MAX)));
    }
    let mut vocab = load_tokenizer(&args.tokenizer, args.eos.as_deref())?;
    ordinary_text(&mut vocab.tokenizer);
    let files = inputs::expand(&args.inputs)?;
    // Locked from the check that it may be written until the dataset is in place; on an error
    // its drop removes the staging, and the directories this prepare created.
    let out = out_dir::OutDir::hold(&args.out, &args.tokenizer)?;
    let m = prepare_into(args, &vocab, &files, out.staging(), stop)?;
    publish(out.staging(), &args.out, &m)?;
    out.published();
    Ok(m)
}

fn prepare_into(
    args: &PrepareArgs,
    vocab: &Vocab,
    files: &[(PathBuf, inputs::Kind)],
    staging: &Path,
    stop: &Interrupter,
) -> Result<Manifest, PrepareError> {
    let write_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| PrepareError::Write { path: path.clone(), source }
    };
    std::fs::copy(&args.tokenizer, staging.join(out_dir::TOKENIZER_FILE))
        .map_err(write_err(&args.tokenizer))?;
    let dtype = Dtype::for_vocab(vocab.size);
    let threads = args.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| PrepareError::Input(format!("cannot start {threads} threads: {e}")))?;
    let input_bytes: u64 = files.iter().map(|(p, _)| std::fs::metadata(p).map_or(0, |m| m.len())).sum();
    let progress = Progress::new(input_bytes);
    let mut out = writer::ShardWriter::new(staging, dtype, args.shard_tokens, args.val_tokens);
    let mut documents = 0u64;
    // Cuts where the ids may differ from the whole document's, counted by reader and workers.
    let forced_cuts = AtomicUsize::new(0);
    // Chunks are read in order, a window of them is tokenized in parallel, and the results are
    // written in order: the output does not depend on the thread count.
    let window = threads * 4;
    let mut pending: Vec<Vec<Piece>> = Vec::with_capacity(window);
    let mut chunk: Vec<Piece> = Vec::new();
    let mut chunk_bytes = 0;
    let flush = |pending: &mut Vec<Vec<Piece>>, out: &mut writer::ShardWriter| -> Result<(), PrepareError> {
        if stop.requested() {
            return Err(PrepareError::Interrupted);
        }
        let encoded: Vec<Result<Vec<u32>, String>> = pool.install(|| {
            pending
                .par_iter()
                .map(|pieces| encode(&vocab.tokenizer, pieces, vocab.eos_id, &forced_cuts))
                .collect()
        });
        for (pieces, toks) in pending.iter().zip(encoded) {
            let toks = toks.map_err(tokenizer_failed)?;
            out.write(&toks).map_err(write_err(staging))?;
            progress.advance(
                pieces.iter().map(|p| p.text.len() as u64 + u64::from(p.ends_doc)).sum(),
                out.total(),
            );
        }
        pending.clear();
        Ok(())
    };
    let mut push = |piece: Piece, out: &mut writer::ShardWriter| -> Result<(), PrepareError> {
        chunk_bytes += piece.text.len();
        chunk.push(piece);
        if chunk_bytes >= CHUNK_BYTES {
            pending.push(std::mem::take(&mut chunk));
            chunk_bytes = 0;
            if pending.len() == window {
                flush(&mut pending, &mut *out)?;
            }
        }
        Ok(())
    };
    for (path, kind) in files {
        let mut docs = inputs::Documents::open(path, *kind, &args.text_field)?;
        while let Some(doc) = docs.next_doc()? {
            documents += 1;
            if doc.len() <= PIECE_BYTES {
                push(Piece { text: doc, ends_doc: true }, &mut out)?;
                continue;
            }
            // A long document goes in pieces, each its own work item: the tokenizer's memory
            // and the ids in flight are those of a window of pieces, whatever the document's size.
            let (ends, forced) = piece_ends(&vocab.tokenizer, &doc).map_err(tokenizer_failed)?;
            forced_cuts.fetch_add(forced, Ordering::Relaxed);
            let mut start = 0;
            for end in ends {
                push(Piece { text: doc[start..end].to_string(), ends_doc: end == doc.len() }, &mut out)?;
                start = end;
            }
        }
    }
    if !chunk.is_empty() {
        pending.push(chunk);
    }
    flush(&mut pending, &mut out)?;
    let forced_cuts = forced_cuts.into_inner();
    if forced_cuts > 0 {
        tracing::warn!(
            "{forced_cuts} cut(s) in long documents (or text the tokenizer's normalizer expands) where no nearby place splits the ids cleanly: each side was tokenized apart, so the tokens next to such a cut may differ from the whole document's"
        );
    }
    out.close().map_err(write_err(staging))?;
    progress.finish();
    let val_tokens: u64 = out.val.iter().map(|s| s.tokens).sum();
    let train_tokens: u64 = out.train.iter().map(|s| s.tokens).sum();
    if train_tokens == 0 {
        let total = train_tokens + val_tokens;
        return Err(PrepareError::Input(format!(
            "the inputs give {total} tokens, none left for training after --val-tokens {}",
            args.val_tokens
        )));
    }
    let (magic, version) = dtype.magic_version();
    Ok(Manifest {
        format: shards::MANIFEST_FORMAT.into(),
        tokenizer: out_dir::TOKENIZER_FILE.into(),
        vocab_size: vocab.size,
        eos_id: vocab.eos_id,
        eos_token: vocab.eos.clone(),
        dtype,
        header_magic: magic,
        header_version: version,
        train: out.train,
        val: out.val,
        train_tokens,
        val_tokens,
        documents,
        input_bytes,
        inputs: files.iter().map(|(p, _)| p.display().to_string()).collect(),
    })
}

/// Makes `tok` encode the spelling of a special token (`<|endoftext|>` in a document) as the
/// text it is, not as that token: otherwise a document quoting it is split by an EOS the
/// trainer takes for a document's end (nanoGPT and llm.c use tiktoken's `encode_ordinary` for
/// this). Added tokens that are not special (vocabulary additions, GPT-NeoX's runs of spaces)
/// are still matched, as Python's `encode_special_tokens = True` has it; the EOS `prepare`
/// appends is the id itself, not text.
fn ordinary_text(tok: &mut Tokenizer) {
    tok.set_encode_special_tokens(true);
}

/// Text tokenized in one call: a document, or a piece of a long one; EOS follows the last.
struct Piece {
    text: String,
    ends_doc: bool,
}

fn tokenizer_failed(e: String) -> PrepareError {
    PrepareError::Input(format!("tokenizer failed: {e}"))
}

/// Tokens of `pieces`, EOS after each that ends a document; `forced` counts the cuts made to
/// bound what the normalizer makes of a piece.
fn encode(tok: &Tokenizer, pieces: &[Piece], eos: u32, forced: &AtomicUsize) -> Result<Vec<u32>, String> {
    let mut out = Vec::with_capacity(pieces.iter().map(|p| p.text.len() / 3).sum());
    for p in pieces {
        let parts = normalized_parts(tok, &p.text)?;
        forced.fetch_add(parts.len() - 1, Ordering::Relaxed);
        for part in parts {
            out.extend(tok.encode_fast(part, false).map_err(|e| e.to_string())?.get_ids());
        }
        if p.ends_doc {
            out.push(eos);
        }
    }
    Ok(out)
}

/// Normalized bytes handed to the tokenizer at once, at most: a normalizer that expands text
/// (NFKC makes U+FDFA's 3 bytes 33) would otherwise multiply a piece's memory by its factor.
const NORMALIZED_BYTES: usize = 2 * PIECE_BYTES;
/// Bytes normalized at once to measure a text's normalized size (its memory: ~17 bytes a byte).
const MEASURE_BYTES: usize = 4 << 10;
/// Texts up to this size are not measured (most documents: measuring costs a second
/// normalization, ~13% of the time under NFKC): even a 32-fold expansion (NFKC's most is 11)
/// keeps them within [`NORMALIZED_BYTES`].
const UNMEASURED_BYTES: usize = NORMALIZED_BYTES / 32;

/// `text` in consecutive parts whose normalized size is at most [`NORMALIZED_BYTES`] (a part
/// of one character excepted), halved (see [`forced_cut`]) until they are; `text` whole when
/// the tokenizer has no normalizer, `text` is at most [`UNMEASURED_BYTES`], or the normalizer
/// does not grow it that far.
fn normalized_parts<'a>(tok: &Tokenizer, text: &'a str) -> Result<Vec<&'a str>, String> {
    let Some(normalizer) = tok.get_normalizer().filter(|_| text.len() > UNMEASURED_BYTES) else {
        return Ok(vec![text]);
    };
    let mut parts = Vec::new();
    let mut todo = vec![text];
    while let Some(t) = todo.pop() {
        let mid = forced_cut(t, t.len() / 2, t.len() / 4);
        if normalized_len(normalizer, t)? <= NORMALIZED_BYTES || mid == 0 {
            parts.push(t);
        } else {
            todo.extend([&t[mid..], &t[..mid]]); // the first half on top: parts stay in order
        }
    }
    Ok(parts)
}

/// The size of `text` normalized, measured [`MEASURE_BYTES`] at a time.
fn normalized_len(normalizer: &impl Normalizer, text: &str) -> Result<usize, String> {
    let (mut len, mut start) = (0, 0);
    while start < text.len() {
        let end = char_start(text, start + MEASURE_BYTES, true);
        let mut s = NormalizedString::from(&text[start..end]);
        normalizer.normalize(&mut s).map_err(|e| e.to_string())?;
        len += s.len();
        start = end;
    }
    Ok(len)
}

/// Documents longer than this are tokenized in pieces of 1 to 2 of it: a tokenizer's working
/// memory is about 130 bytes per byte of its input (more where its normalizer expands the text),
/// and a file of single-newline lines is one `.txt` document (a 1 GB one would have needed
/// ~130 GB at once).
const PIECE_BYTES: usize = 1 << 20;
/// Bytes each side of a piece's end tokenized to check it.
const SEAM_BYTES: usize = 256;
/// Seams checked before a piece is cut where the ids may not split cleanly.
const SEAM_TRIES: usize = 4;

/// Where `doc` is cut into pieces tokenized apart: the end of each, the last `doc.len()`; and
/// how many cuts were forced. A piece ends at a line's start or before the space that starts a
/// word, and only where the text around that point gives the same ids whole as in two halves
/// (GPT-2's `\s+(?!\S)` splits a blank line's breaks otherwise: such a line start is passed
/// over), so the ids are the whole document's. Where the [`PIECE_BYTES`] after a piece's first
/// [`PIECE_BYTES`] hold no such place within [`SEAM_TRIES`] checks (no spaces or line breaks, or
/// a tokenizer whose every seam fails), the cut is forced (see [`forced_cut`]): a piece is never
/// longer than twice [`PIECE_BYTES`], whatever the text.
fn piece_ends(tok: &Tokenizer, doc: &str) -> Result<(Vec<usize>, usize), String> {
    let ids = |s: &str| tok.encode_fast(s, false).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string());
    let (mut ends, mut forced, mut start) = (Vec::new(), 0, 0);
    while doc.len() - start > PIECE_BYTES {
        let from = start + PIECE_BYTES;
        start = match seam(doc, from, &ids)? {
            Some(end) => end,
            None => {
                forced += 1;
                forced_cut(doc, from, PIECE_BYTES)
            }
        };
        ends.push(start);
    }
    ends.push(doc.len());
    Ok((ends, forced))
}

/// A cut at or after byte `from` of `doc` where no clean seam was found: before the first ASCII
/// whitespace in the `reach` bytes from there (words stay whole), else at the character
/// boundary at or before `from`. The text each side is tokenized (and normalized) apart: a merge
/// across the cut is not made, and a tokenizer that prefixes its input (a Metaspace
/// `prepend_scheme: always`) prefixes the piece after it.
fn forced_cut(doc: &str, from: usize, reach: usize) -> usize {
    let window = &doc.as_bytes()[from..doc.len().min(from + reach)];
    match window.iter().position(u8::is_ascii_whitespace) {
        Some(i) => from + i,
        None => char_start(doc, from, false),
    }
}

/// The first place in the [`PIECE_BYTES`] from byte `from` of `doc` where the ids split cleanly
/// (see [`piece_ends`]), within [`SEAM_TRIES`] checks.
fn seam(
    doc: &str,
    from: usize,
    ids: &impl Fn(&str) -> Result<Vec<u32>, String>,
) -> Result<Option<usize>, String> {
    let bytes = doc.as_bytes();
    let space = |i: usize| bytes[i].is_ascii_whitespace();
    // A line's start (after a line break, not indented) or a single space before a word.
    let candidate = |p: usize| {
        !space(p) && bytes[p - 1] == b'\n'
            || bytes[p] == b' ' && !space(p - 1) && p + 1 < bytes.len() && !space(p + 1)
    };
    let mut tries = 0;
    for p in char_start(doc, from, true).max(1)..bytes.len().min(from + PIECE_BYTES) {
        if tries == SEAM_TRIES {
            break;
        }
        if !doc.is_char_boundary(p) || !candidate(p) {
            continue;
        }
        tries += 1;
        let (l, r) =
            (char_start(doc, p.saturating_sub(SEAM_BYTES), false), char_start(doc, p + SEAM_BYTES, true));
        let mut halves = ids(&doc[l..p])?;
        halves.extend(ids(&doc[p..r])?);
        if ids(&doc[l..r])? == halves {
            return Ok(Some(p));
        }
    }
    Ok(None)
}

/// The char boundary at or after (`up`) or at or before byte `i` of `s`, within `s`.
fn char_start(s: &str, i: usize, up: bool) -> usize {
    let mut i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i = if up { i + 1 } else { i - 1 };
    }
    i
}

/// Moves the finished files into `out`, `dataset.json` last: a reader sees a manifest only
/// when every shard it lists is in place.
fn publish(staging: &Path, out: &Path, m: &Manifest) -> Result<(), PrepareError> {
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| PrepareError::Write { path: path.clone(), source }
    };
    for f in m.val.iter().chain(&m.train).map(|s| s.file.as_str()).chain([out_dir::TOKENIZER_FILE]) {
        std::fs::rename(staging.join(f), out.join(f)).map_err(err(&out.join(f)))?;
    }
    let text = serde_json::to_string_pretty(m).expect("a Manifest always serialises");
    let tmp = staging.join(shards::MANIFEST_FILE);
    std::fs::write(&tmp, text + "\n").map_err(err(&tmp))?;
    std::fs::rename(&tmp, out.join(shards::MANIFEST_FILE)).map_err(err(out))?;
    Ok(())
}

/// A progress bar (bytes read, tokens/s) on a terminal; nothing otherwise.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    start: Instant,
}

impl Progress {
    fn new(total_bytes: u64) -> Self {
        let bar = (std::io::stderr().is_terminal() && std::env::var_os("TRAINGUARD_NO_PROGRESS").is_none())
            .then(|| {
                let b = indicatif::ProgressBar::new(total_bytes);
                b.set_style(
                    indicatif::ProgressStyle::with_template(
                        "{bar:30} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} {msg} ETA {eta}",
                    )
                    .expect("a valid template"),
                );
                b
            });
        Self { bar, start: Instant::now() }
    }

    fn advance(&self, bytes: u64, tokens: u64) {
        if let Some(b) = &self.bar {
            b.inc(bytes);
            let rate = tokens as f64 / self.start.elapsed().as_secs_f64().max(1e-9);
            b.set_message(format!("{tokens} tokens, {:.2}M tokens/s", rate / 1e6));
        }
    }

    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A word-level tokenizer over `x` and `y` with the given pre-tokenizer.
    fn tokenizer(pre_tokenizer: &str) -> Tokenizer {
        let json = format!(
            r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":{pre_tokenizer},"post_processor":null,"decoder":null,
            "model":{{"type":"WordLevel","vocab":{{"[UNK]":0,"x":1,"y":2,"▁x":3,"▁y":4,"x\ny":5,"▁x\ny":6,"Ċ":7,"ĊĊ":8}},"unk_token":"[UNK]"}}}}"#
        );
        json.parse().unwrap()
    }

    #[test]
    fn a_token_id_beyond_any_models_vocabulary_is_refused_when_the_tokenizer_loads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let json = |top: u64| {
            format!(
                r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,"model":{{"type":"WordLevel","vocab":{{"[UNK]":0,"</s>":1,"x":{top}}},"unk_token":"[UNK]"}}}}"#
            )
        };
        std::fs::write(&path, json(4294967295)).unwrap();
        let err = load_tokenizer(&path, None).err().unwrap().to_string();
        assert!(err.contains("a token id of 4294967295 is beyond the largest vocabulary"), "{err}");
        std::fs::write(&path, json(2)).unwrap();
        assert_eq!(load_tokenizer(&path, None).unwrap().size, 3);
    }

    #[test]
    fn a_tokenizer_that_does_not_load_is_said_as_what_the_file_is() {
        let dir = tempfile::tempdir().unwrap();
        let err = |text: Option<&str>| {
            let path = dir.path().join("t.json");
            let _ = std::fs::remove_file(&path);
            if let Some(t) = text {
                std::fs::write(&path, t).unwrap();
            }
            load_tokenizer(&path, None).err().expect("refused").to_string()
        };
        let e = err(None);
        assert!(e.ends_with("t.json: tokenizer file not found"), "{e}");
        let e = err(Some(r#"{"a":1}"#));
        assert!(e.contains("is JSON but not a tokenizer.json: it has no `model` (its keys: `a`)"), "{e}");
        assert!(!e.contains("line 1 column"), "no syntax error where the syntax is fine: {e}");
        assert!(err(Some("[1, 2]")).contains("is JSON but not a tokenizer.json: not an object"));
        let e =
            err(Some(r#"{"model": {"type": "WordLevel", "vocab": {"x": 0}, "unk_token": "x"}, "extra": 1}"#));
        assert!(e.contains("top-level `extra` it does not know"), "{e}");
        let e = err(Some(r#"{"model": 3}"#));
        assert!(e.contains("not a valid tokenizer.json: "), "{e}");
        let e = err(Some("{model"));
        assert!(
            e.contains("not a tokenizer.json: not JSON (key must be a string at line 1 column 2)"),
            "{e}"
        );
    }

    #[test]
    fn thread_counts_are_bounded() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: PrepareArgs,
        }
        let parse = |threads: &str| {
            Cli::try_parse_from([
                "prepare",
                "--tokenizer",
                "t.json",
                "--out",
                "o",
                "in.txt",
                "--threads",
                threads,
            ])
            .map(|c| c.args.threads)
        };
        assert_eq!(parse("8").unwrap(), Some(8));
        assert!(parse("0").is_err() && parse("100000").is_err());
    }

    fn whole(tok: &Tokenizer, doc: &str) -> Vec<u32> {
        tok.encode_fast(doc, false).unwrap().get_ids().to_vec()
    }

    /// The pieces `doc` is tokenized in, and how many cuts were forced.
    fn pieces<'a>(tok: &Tokenizer, doc: &'a str) -> (Vec<&'a str>, usize) {
        let (ends, forced) = piece_ends(tok, doc).unwrap();
        let starts = std::iter::once(0).chain(ends.iter().copied());
        (starts.zip(&ends).map(|(a, &b)| &doc[a..b]).collect(), forced)
    }

    /// The ids of `doc` tokenized in its pieces, as `prepare` writes them.
    fn encode_doc(tok: &Tokenizer, doc: &str) -> Vec<u32> {
        pieces(tok, doc).0.iter().flat_map(|p| whole(tok, p)).collect()
    }

    #[test]
    fn a_long_document_is_tokenized_in_pieces_only_where_the_ids_are_the_same() {
        let doc = "xy\n  x\n".repeat((PIECE_BYTES * 5 / 2) / 7);
        // Whitespace-split words: every line start is a clean seam (an indented one is skipped).
        let plain = tokenizer(r#"{"type":"Whitespace"}"#);
        let p = seam(&doc, PIECE_BYTES, &|s: &str| Ok(whole(&plain, s))).unwrap().expect("a seam");
        assert!(
            p >= PIECE_BYTES && doc[..p].ends_with("  x\n"),
            "after a line break, before a line that does not start with a space"
        );
        assert_eq!(encode_doc(&plain, &doc), whole(&plain, &doc));
        // One line: before the space that starts a word.
        let line = "x y  y".repeat(PIECE_BYTES / 3);
        let p = seam(&line, PIECE_BYTES, &|s: &str| Ok(whole(&plain, s))).unwrap().expect("a seam");
        assert!(
            line[..p].ends_with('x') && line[p..].starts_with(" y"),
            "{}|{}",
            &line[p - 3..p],
            &line[p..p + 3]
        );
        assert_eq!(encode_doc(&plain, &line), whole(&plain, &line));
        // A prefix added at each input's start: no seam is clean, the cut is forced before the
        // first whitespace after a piece's first PIECE_BYTES.
        let prefixed =
            tokenizer(r#"{"type":"Metaspace","replacement":"▁","prepend_scheme":"always","split":true}"#);
        assert_eq!(seam(&doc, PIECE_BYTES, &|s: &str| Ok(whole(&prefixed, s))).unwrap(), None);
        let (parts, forced) = pieces(&prefixed, &doc);
        assert_eq!((parts.len(), forced), (3, 2));
        assert!(
            parts[1].starts_with(|c: char| c.is_ascii_whitespace())
                && parts[..2].iter().all(|p| (PIECE_BYTES..PIECE_BYTES + 8).contains(&p.len()))
        );
        // GPT-2's byte-level split: `\s+(?!\S)` keeps a blank line's two breaks apart before a
        // word, and together at the end of a half. A seam after a blank line is passed over,
        // one after a single break is taken.
        let byte_level = tokenizer(
            r#"{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true}"#,
        );
        let ids = |s: &str| Ok(whole(&byte_level, s));
        assert_ne!(
            [whole(&byte_level, "x\n\n"), whole(&byte_level, "y")].concat(),
            whole(&byte_level, "x\n\ny"),
            "the split this guards against"
        );
        let mixed = "x\n\ny\n".repeat((PIECE_BYTES * 5 / 2) / 5);
        let p = seam(&mixed, PIECE_BYTES, &ids).unwrap().expect("a seam");
        assert!(mixed[..p].ends_with("y\n"), "after the single break: {:?}", &mixed[p - 3..p]);
        assert_eq!(encode_doc(&byte_level, &mixed), whole(&byte_level, &mixed));
        let blank_lines = "x\n\n".repeat((PIECE_BYTES * 5 / 2) / 3);
        assert_eq!(
            seam(&blank_lines, PIECE_BYTES, &ids).unwrap(),
            None,
            "every line start follows a blank line"
        );
        let (parts, forced) = pieces(&byte_level, &blank_lines);
        assert!(forced == 2 && parts.iter().all(|p| p.len() <= PIECE_BYTES + 3), "{forced} forced");
        assert_eq!(parts.concat(), blank_lines);
        // Byte offsets inside a character are moved to its start or end.
        assert_eq!((char_start("aé", 2, true), char_start("aé", 2, false)), (3, 1));
    }

    #[test]
    fn text_a_normalizer_expands_is_tokenized_in_parts_of_bounded_normalized_size() {
        let mut tok = tokenizer(r#"{"type":"Whitespace"}"#);
        // NFKC makes U+FDFA's 3 bytes 33: a 1 MiB piece, 11 MiB.
        let text = "\u{fdfa}".repeat(PIECE_BYTES / 3);
        assert_eq!(normalized_parts(&tok, &text).unwrap(), [text.as_str()], "no normalizer");
        tok.with_normalizer(Some(tokenizers::normalizers::unicode::NFKC)).unwrap();
        let parts = normalized_parts(&tok, &text).unwrap();
        let nfkc = tok.get_normalizer().unwrap();
        let sizes: Vec<usize> = parts.iter().map(|p| normalized_len(nfkc, p).unwrap()).collect();
        assert!(
            parts.len() >= 6 && sizes.iter().all(|&n| n <= NORMALIZED_BYTES && n > NORMALIZED_BYTES / 4),
            "{sizes:?}"
        );
        assert_eq!(parts.concat(), text, "in order, cut at character boundaries");
        // Text it leaves as it is: whole.
        let plain = "x y ".repeat(PIECE_BYTES / 2);
        assert_eq!(normalized_parts(&tok, &plain).unwrap().len(), 1);
        let (forced, n) = (AtomicUsize::new(0), parts.len());
        let piece = Piece { text: text.clone(), ends_doc: true };
        let ids = encode(&tok, std::slice::from_ref(&piece), 9, &forced).unwrap();
        assert_eq!((ids.last(), forced.into_inner()), (Some(&9), n - 1));
    }

    #[test]
    fn text_without_whitespace_is_cut_at_a_character_boundary_every_piece() {
        let byte_level = tokenizer(
            r#"{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":true}"#,
        );
        // 3 bytes a character: PIECE_BYTES from a piece's start falls inside one at times.
        let doc = "aé".repeat(PIECE_BYTES * 7 / 2 / 3);
        let (parts, forced) = pieces(&byte_level, &doc);
        assert_eq!((parts.len(), forced), (4, 3));
        assert!(parts[..3].iter().all(|p| (PIECE_BYTES - 3..=PIECE_BYTES).contains(&p.len())));
        assert_eq!(parts.concat(), doc, "cut at character boundaries (a slice inside one panics)");
        // A document of at most PIECE_BYTES is one piece.
        assert_eq!(pieces(&byte_level, &doc[..char_start(&doc, PIECE_BYTES, false)]).0.len(), 1);
    }
}
