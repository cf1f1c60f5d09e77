//! `trainguard sample`: opens a trained model (a checkpoint directory, a run directory — its
//! final `model.safetensors`, else its newest checkpoint — or a Hugging Face directory written by
//! `export`) and continues a prompt with temperature and top-k sampling. The draws come from
//! trainguard's own hash of (seed, position), so a seed gives the same text on every run. Text
//! is encoded and decoded with the tokenizer of the run's `prepare` dataset, as bytes for
//! byte-level data (`synthetic`, `text:`), or as space-separated ids for token data without one.
use crate::checkpoint::store;
use crate::config::{Config, KernelsConfig, ModelConfig};
use crate::data::shards;
use crate::fs::run_files;
use crate::model::Model;
use clap::Args;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

#[derive(Debug, Args)]
pub struct SampleArgs {
    /// A checkpoint directory, a run directory, or a directory written by `export --hf`.
    pub target: PathBuf,
    #[arg(long, default_value = "")]
    pub prompt: String,
    #[arg(long, default_value_t = 200)]
    pub max_tokens: usize,
    /// 0: always the most likely token.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample among the K most likely tokens only; 0: all.
    #[arg(long, default_value_t = 50)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// `auto` (CUDA when present), `cpu`, `cuda`, `cuda:N`.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Go on past the end-of-document token. By default the continuation ends where the model
    /// draws it, as transformers' `generate` does: what follows would be another document.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Token ids instead of --prompt (comma-separated); for tests.
    #[arg(long, hide = true, value_delimiter = ',')]
    pub ids: Vec<i64>,
    /// Write the logits of the prompt (`logits` [1, t, vocab], fp32) to this safetensors file and
    /// stop; for comparing with other implementations.
    #[arg(long, hide = true, value_name = "FILE")]
    pub dump_logits: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    /// The target, a flag or the run's files are not usable (exit 2).
    #[error("{0}")]
    Input(String),
    #[error(transparent)]
    Torch(#[from] tch::TchError),
    #[error("cannot write to standard output: {0}")]
    Output(std::io::Error),
}

pub fn is_usage(cause: &(dyn std::error::Error + 'static)) -> bool {
    matches!(cause.downcast_ref::<SampleError>(), Some(SampleError::Input(_)))
}

fn input(m: impl Into<String>) -> SampleError {
    SampleError::Input(m.into())
}

/// A trained model's config, weights and, when its data came from `prepare`, its tokenizer.
pub struct Trained {
    pub model: ModelConfig,
    /// The run's `kernels:` (the defaults for a Hugging Face directory), so sampling computes as
    /// training did.
    pub kernels: KernelsConfig,
    pub seed: u64,
    pub weights: Vec<(String, Tensor)>,
    /// Where the tokenizer is: the `prepare` directory behind `data.source`, or the exported
    /// directory itself.
    pub dataset: Option<Dataset>,
    /// Why the run's `prepare` dataset cannot be read from here (moved, a relative path read
    /// from another directory, its tokenizer gone): said, not taken for data without one.
    pub dataset_unusable: Option<String>,
    /// Byte-level data (`synthetic`, `text:`): token i is byte i.
    pub bytes: bool,
}

/// A directory holding the tokenizer.json of a trained model's data.
pub struct Dataset {
    pub dir: PathBuf,
    /// A `prepare` directory's dataset.json, read once (an exported directory has none).
    pub manifest: Option<shards::Manifest>,
    /// Its tokenizer.json, loaded with its end-of-document token: `sample` decodes with it, and
    /// `export` copies only a tokenizer that loads.
    pub vocab: crate::data::prepare::Vocab,
    /// The start and unknown tokens an exported directory names (a prepared dataset: none).
    pub specials: crate::hf::Specials,
}

impl Dataset {
    /// Its tokenizer.json (a `prepare` directory names it in its manifest).
    pub fn tokenizer_file(&self) -> PathBuf {
        self.dir.join(self.manifest.as_ref().map_or("tokenizer.json", |m| m.tokenizer.as_str()))
    }
}

/// Opens a checkpoint, a run directory or an exported Hugging Face directory.
pub fn open(target: &Path) -> Result<Trained, SampleError> {
    if target.join("config.json").is_file() && !target.join(run_files::CONFIG).is_file() {
        let (model, weights) = crate::hf::import(target).map_err(|e| input(e.to_string()))?;
        let tokenizer = target.join("tokenizer.json");
        let (dataset, dataset_unusable) = match tokenizer.is_file().then(|| {
            crate::data::prepare::load_tokenizer(&tokenizer, crate::hf::exported_eos(target).as_deref())
        }) {
            None => (None, None),
            Some(Ok(vocab)) => (
                Some(Dataset {
                    dir: target.to_path_buf(),
                    manifest: None,
                    specials: crate::hf::specials(target, &vocab.tokenizer),
                    vocab,
                }),
                None,
            ),
            Some(Err(e)) => (None, Some(e.to_string())),
        };
        return Ok(Trained {
            model,
            kernels: KernelsConfig::default(),
            seed: 0,
            weights,
            dataset,
            dataset_unusable,
            bytes: false,
        });
    }
    if !target.is_dir() {
        let what = if target.exists() { "not a directory" } else { "no such directory" };
        return Err(input(format!(
            "{}: {what} (a checkpoint, run or Hugging Face directory is expected)",
            target.display()
        )));
    }
    let final_weights = target.join(run_files::WEIGHTS);
    // `recorded`: what the run trained on, as its checkpoint says (a run's final weights: its
    // newest checkpoint's word for it).
    let (config, weights, recorded) = if target.join(run_files::STATE).is_file() {
        let l = store::load_checkpoint(target).map_err(|e| input(e.to_string()))?;
        (l.config, l.weights, l.state.data)
    } else if target.join(run_files::CONFIG).is_file() && final_weights.is_file() {
        let yaml = crate::fs::whole_file::read_string_at_most(
            &target.join(run_files::CONFIG),
            crate::config::limits::MAX_CONFIG_BYTES,
        )
        .map_err(|e| input(format!("{}: {e}", target.join(run_files::CONFIG).display())))?;
        let config: Config = crate::config::saved(&yaml)
            .map_err(|e| input(format!("{}: {e}", target.join(run_files::CONFIG).display())))?;
        let recorded = store::list(&store::root(target))
            .last()
            .and_then(|(_, dir)| store::load_state(dir).ok())
            .and_then(|s| s.data);
        (
            config,
            store::read_model_file(&final_weights)
                .map_err(|m| input(format!("{}: {m}", final_weights.display())))?,
            recorded,
        )
    } else {
        // A run without final weights (or without its config.yaml): its newest checkpoint that
        // loads, which carries its own config. Those passed over are named.
        let root = store::root(target);
        if !root.is_dir() {
            return Err(input(format!("{}: not a checkpoint, run or Hugging Face directory (no {}, {}, checkpoints/ or config.json)", target.display(), run_files::STATE, run_files::CONFIG)));
        }
        let (newest, skipped) = store::newest_valid(&root);
        let why = || skipped.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ");
        match newest {
            Some(l) => {
                if !skipped.is_empty() {
                    tracing::warn!("passed over: {}; using {}", why(), l.path.display());
                }
                (l.config, l.weights, l.state.data)
            }
            None if skipped.is_empty() => {
                return Err(input(format!("{}: no model.safetensors and no checkpoint", target.display())))
            }
            None => {
                return Err(input(format!(
                    "{}: no model.safetensors, and no checkpoint loads: {}",
                    target.display(),
                    why()
                )))
            }
        }
    };
    let (dataset, dataset_unusable) =
        match dataset_dir(config.data.primary_source()).and_then(|d| trained_with(d, recorded.as_ref())) {
            Ok(dir) => (dir, None),
            Err(why) => (None, Some(why)),
        };
    let bytes = !config.data.primary_source().starts_with("tokens:");
    Ok(Trained {
        model: config.model.clone(),
        kernels: config.kernels,
        seed: config.seed,
        weights,
        dataset,
        dataset_unusable,
        bytes,
    })
}

/// `dataset` when its tokenizer is the one the run recorded (or nothing was recorded): a dataset
/// re-made in place with another tokenizer would encode the prompt and decode the output as
/// other text, and an export would pair the model with a tokenizer it never saw.
fn trained_with(
    dataset: Option<Dataset>,
    recorded: Option<&crate::checkpoint::state::DataRecord>,
) -> Result<Option<Dataset>, String> {
    let (Some(d), Some(then)) = (&dataset, recorded.and_then(|r| r.tokenizer_crc32c)) else {
        return Ok(dataset);
    };
    let now = d.manifest.as_ref().and_then(|m| shards::tokenizer_checksum(&d.dir, m));
    match now {
        Some(now) if now != then => Err(format!(
            "{} is not the tokenizer the run trained with (CRC-32C {now:08x}, {then:08x} when trained; re-prepared since?)",
            d.tokenizer_file().display()
        )),
        _ => Ok(dataset),
    }
}

/// The `prepare` directory a `tokens:` source names, when it has a manifest (None: other data,
/// shards without a tokenizer); an error says why the source cannot be read from here.
pub fn dataset_dir(source: &str) -> Result<Option<Dataset>, String> {
    let Some(p) = source.strip_prefix("tokens:") else { return Ok(None) };
    let path = Path::new(p);
    if !path.exists() {
        if p.contains(['*', '?', '[']) {
            return Ok(None); // a glob of shards: no tokenizer
        }
        let here = std::env::current_dir().map(|d| format!(" from {}", d.display())).unwrap_or_default();
        let relative = if path.is_relative() {
            " (a relative path is read from the directory a command runs in: run it from the one training ran in)"
        } else {
            ""
        };
        return Err(format!("the run's data.source `{source}` is not found{here}{relative}"));
    }
    let manifest = path.join(shards::MANIFEST_FILE);
    if !manifest.is_file() {
        return Ok(None);
    }
    let m: shards::Manifest = crate::fs::whole_file::read_regular_string(&manifest)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
        .map_err(|e| format!("{}: {e}", manifest.display()))?;
    let tokenizer = path.join(&m.tokenizer);
    if !tokenizer.is_file() {
        return Err(format!(
            "{} is missing: the tokenizer of the run's data.source `{source}`",
            tokenizer.display()
        ));
    }
    // One that does not load (damaged, another tokenizer without the dataset's end-of-document
    // token) is as unusable as a missing one.
    let vocab = crate::data::prepare::load_tokenizer(&tokenizer, Some(&m.eos_token))
        .map_err(|e| format!("{e}: the tokenizer of the run's data.source `{source}`"))?;
    Ok(Some(Dataset { dir: path.to_path_buf(), manifest: Some(m), vocab, specials: Default::default() }))
}

/// Builds the model on `device` and copies `weights` into it by name.
pub fn build(t: &Trained, device: Device) -> Result<Model, SampleError> {
    let model = Model::with_kernels(&t.model, t.kernels, t.seed, device)?;
    copy_weights(&model, &t.weights).map_err(input)?;
    if let Some(why) = crate::hf::unplaced(&model, &t.weights) {
        return Err(input(why));
    }
    Ok(model)
}

/// Copies named tensors into the model's parameters; every parameter must be present with its
/// shape (a vocabulary matrix padded as the model pads it, or with the user's rows: a Hugging
/// Face directory, a checkpoint from before `model.pad_vocab_to`).
pub fn copy_weights(model: &Model, weights: &[(String, Tensor)]) -> Result<(), String> {
    for (i, name) in model.params.names.iter().enumerate() {
        let src = weights
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
            .ok_or_else(|| format!("the weights lack `{name}`"))?;
        model.copy_user_tensor(i, src).map_err(|e| format!("`{name}` has {e}"))?;
    }
    Ok(())
}

enum Codec {
    Bytes,
    Tokenizer(Box<tokenizers::Tokenizer>, u32),
    /// Token data without a tokenizer (a bare shard or train.bin; or, with why, a `prepare`
    /// dataset that cannot be read from here): ids in, ids out.
    Ids(Option<String>),
}

impl Codec {
    fn open(t: &Trained) -> Result<Self, SampleError> {
        let Some(d) = &t.dataset else {
            if let Some(why) = &t.dataset_unusable {
                tracing::warn!("{why}: prompts and output are token ids");
            }
            return Ok(if t.bytes { Codec::Bytes } else { Codec::Ids(t.dataset_unusable.clone()) });
        };
        Ok(Codec::Tokenizer(Box::new(d.vocab.tokenizer.clone()), d.vocab.eos_id))
    }

    fn encode(&self, text: &str) -> Result<Vec<i64>, SampleError> {
        match self {
            Codec::Bytes => Ok(text.bytes().map(i64::from).collect()),
            Codec::Ids(why) => {
                let why = why
                    .as_deref()
                    .unwrap_or("this run's data has no tokenizer (data.source is not a prepare directory)");
                text.split_whitespace()
                    .map(|w| {
                        w.parse()
                            .map_err(|_| input(format!("{why}: give the prompt as token ids, got `{w}`")))
                    })
                    .collect()
            }
            Codec::Tokenizer(t, eos) => {
                let ids: Vec<i64> = t
                    .encode(text, false)
                    .map_err(|e| input(e.to_string()))?
                    .get_ids()
                    .iter()
                    .map(|&i| i as i64)
                    .collect();
                if ids.is_empty() && !text.is_empty() {
                    // Not the empty prompt's fresh document: what was asked for would be lost.
                    return Err(input(format!("--prompt {text:?} gives no tokens with this tokenizer (it has no unknown token for what its vocabulary lacks)")));
                }
                // An empty prompt starts a fresh document.
                Ok(if ids.is_empty() { vec![*eos as i64] } else { ids })
            }
        }
    }

    /// The end-of-document token, where a tokenizer names one (byte-level and bare token data
    /// have none).
    fn eos(&self) -> Option<i64> {
        match self {
            Codec::Tokenizer(_, eos) => Some(*eos as i64),
            _ => None,
        }
    }

    fn decode(&self, ids: &[i64]) -> String {
        match self {
            // An id past the bytes (a model.vocab_size above 256) is no byte: U+FFFD, as for
            // bytes that are not UTF-8, rather than the byte it wraps around to.
            Codec::Bytes => ids
                .split(|&i| !(0..256).contains(&i))
                .map(|run| {
                    String::from_utf8_lossy(&run.iter().map(|&i| i as u8).collect::<Vec<_>>()).into_owned()
                })
                .collect::<Vec<_>>()
                .join("\u{FFFD}"),
            // An id the tokenizer lacks (a model.vocab_size above the tokenizer's: untrained
            // rows) would be skipped by its decode, the text shorter than drawn: U+FFFD, as a
            // byte-level run shows one.
            Codec::Tokenizer(t, _) => {
                let known = t.get_vocab_size(true) as i64;
                ids.split(|&i| !(0..known).contains(&i))
                    .map(|run| {
                        t.decode(&run.iter().map(|&i| i as u32).collect::<Vec<_>>(), false)
                            .unwrap_or_default()
                    })
                    .collect::<Vec<_>>()
                    .join("\u{FFFD}")
            }
            Codec::Ids(_) => ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(" "),
        }
    }
}

/// `--device`, as `train` resolves `device` (a CUDA device this machine does not have is the
/// user's error, named, not libtorch's failure later).
fn device_from(name: &str) -> Result<Device, SampleError> {
    let cuda_devices = tch::Cuda::device_count().max(0) as usize;
    crate::run_plan::resolve_device(name, cuda_devices, 0).map_err(|e| input(format!("--device: {e}")))
}

/// Runs the command: hands the prompt's continuation to `emit` as it is drawn (each part whole
/// characters; `emit` answers false once no one reads) and returns it whole (nothing with
/// --dump-logits).
pub fn run(
    args: &SampleArgs,
    emit: &mut dyn FnMut(&str) -> std::io::Result<bool>,
) -> Result<String, SampleError> {
    let device = device_from(&args.device)?;
    if !(args.temperature >= 0.0 && args.temperature.is_finite()) {
        return Err(input(format!("--temperature must be a number >= 0, got {}", args.temperature)));
    }
    let trained = open(&args.target)?;
    let codec = Codec::open(&trained)?;
    let model = build(&trained, device)?;
    let vocab = trained.model.vocab_size as i64;
    let ids = if args.ids.is_empty() { codec.encode(&args.prompt)? } else { args.ids.clone() };
    if ids.is_empty() {
        return Err(input(match codec {
            Codec::Ids(_) => {
                "--prompt is empty and this run's data has no start token: give the prompt as token ids"
            }
            _ => "--prompt is empty and byte-level data has no start token: give a prompt",
        }));
    }
    if let Some(bad) = ids.iter().find(|&&i| i < 0 || i >= vocab) {
        return Err(input(format!("token id {bad} is outside the model's vocabulary of {vocab}")));
    }
    let _no_grad = tch::no_grad_guard();
    if let Some(path) = &args.dump_logits {
        let t = ids.len().min(trained.model.seq_len);
        let x = Tensor::f_from_slice(&ids[ids.len() - t..])?.f_view([1, t as i64])?.f_to_device(device)?;
        let logits = model
            .forward(&x, false, None)?
            .f_to_kind(Kind::Float)?
            .f_to_device(Device::Cpu)?
            .f_contiguous()?;
        Tensor::write_safetensors(&[("logits", &logits)], path)?;
        return Ok(String::new());
    }
    let draw = |context: &[i64], pos: usize| -> Result<i64, SampleError> {
        let t = context.len().min(trained.model.seq_len);
        let x = Tensor::f_from_slice(&context[context.len() - t..])?
            .f_view([1, t as i64])?
            .f_to_device(device)?;
        let logits = model
            .forward(&x, false, None)?
            .f_select(1, t as i64 - 1)?
            .f_view([-1])?
            .f_to_kind(Kind::Double)?
            .f_to_device(Device::Cpu)?;
        let logits: Vec<f64> = Vec::try_from(&logits)?;
        let u = (crate::data::mix(&[args.seed, pos as u64]) >> 11) as f64 / (1u64 << 53) as f64;
        Ok(pick(&logits, args.temperature, args.top_k, u) as i64)
    };
    let stop_at = if args.ignore_eos { None } else { codec.eos() };
    generate(ids, args.max_tokens, stop_at, &codec, draw, emit)
}

/// Draws up to `max_tokens` after `prompt` (`draw`: the next id given every id so far and the
/// position), ending before `stop_at`; streams the text through `emit` as it becomes final and
/// returns the whole of it.
fn generate(
    mut ids: Vec<i64>,
    max_tokens: usize,
    stop_at: Option<i64>,
    codec: &Codec,
    mut draw: impl FnMut(&[i64], usize) -> Result<i64, SampleError>,
    emit: &mut dyn FnMut(&str) -> std::io::Result<bool>,
) -> Result<String, SampleError> {
    let (start, mut stream, mut whole) = (ids.len(), Stream::default(), String::new());
    for pos in 0..max_tokens {
        let id = draw(&ids, pos)?;
        if Some(id) == stop_at {
            break;
        }
        ids.push(id);
        // Decoded whole each time: a tokenizer's decode of a part need not be that part of the
        // whole (spaces between words, a character's bytes split across tokens).
        whole = codec.decode(&ids[start..]);
        let part = stream.advance(&whole, false).unwrap_or_default();
        if !part.is_empty() && !emit(&part).map_err(SampleError::Output)? {
            return Ok(stream.printed); // the reader went away (`| head`): nothing more to draw for
        }
    }
    match stream.advance(&whole, true) {
        Some(rest) if !rest.is_empty() => {
            emit(&rest).map_err(SampleError::Output)?;
        }
        Some(_) => {}
        None => tracing::warn!("the tokenizer changed text already printed as later tokens came: the whole continuation decodes as {whole:?}"),
    }
    Ok(whole)
}

/// The part of a growing continuation that can be printed: the decode of every token drawn so
/// far, past what was printed, once it extends what was printed (a tokenizer may revise the
/// end), and less its trailing U+FFFD until the last token (a character whose bytes are still
/// to come decodes as one for now).
#[derive(Default)]
struct Stream {
    printed: String,
}

impl Stream {
    /// What to print now; None while `decoded` does not begin with what was printed.
    fn advance(&mut self, decoded: &str, last: bool) -> Option<String> {
        let new = decoded.strip_prefix(self.printed.as_str())?;
        let new = if last { new } else { new.trim_end_matches('\u{FFFD}') };
        self.printed.push_str(new);
        Some(new.to_string())
    }
}

/// The token drawn from `logits` at `temperature` among the `top_k` best (0: all), by inverse
/// CDF at the uniform `u`; temperature 0 is the arg-max. Ties keep the lower id.
pub fn pick(logits: &[f64], temperature: f64, top_k: usize, u: f64) -> usize {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if temperature == 0.0 {
        return order[0];
    }
    let k = if top_k == 0 { order.len() } else { top_k.min(order.len()) };
    let top = &order[..k];
    let max = logits[top[0]];
    let weights: Vec<f64> = top.iter().map(|&i| ((logits[i] - max) / temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    for (&i, w) in top.iter().zip(&weights) {
        acc += w / total;
        if u < acc {
            return i;
        }
    }
    top[k - 1]
}

#[cfg(test)]
mod tests {
    use super::{generate, pick, Codec, Stream};

    #[test]
    fn byte_level_ids_past_the_bytes_decode_as_replacement_characters() {
        assert_eq!(Codec::Bytes.decode(&[104, 105, 299, 33]), "hi\u{FFFD}!");
        assert_eq!(Codec::Bytes.decode(&[256, 300, 104]), "\u{FFFD}\u{FFFD}h", "one per id");
        assert_eq!(Codec::Bytes.encode("hé").unwrap(), [104, 195, 169]);
        assert_eq!(Codec::Bytes.decode(&[104, 195, 169]), "hé");
    }

    #[test]
    fn ids_the_tokenizer_lacks_decode_as_replacement_characters() {
        use tokenizers::models::wordlevel::WordLevel;
        let vocab =
            [("a".to_string(), 0), ("b".to_string(), 1), ("[UNK]".to_string(), 2)].into_iter().collect();
        let model = WordLevel::builder().vocab(vocab).unk_token("[UNK]".into()).build().unwrap();
        let codec = Codec::Tokenizer(Box::new(tokenizers::Tokenizer::new(model)), 2);
        assert_eq!(codec.decode(&[0, 1]), "a b");
        assert_eq!(
            codec.decode(&[0, 7, 1, 3, 3]),
            "a\u{FFFD}b\u{FFFD}\u{FFFD}",
            "one per id past the tokenizer's 3, none dropped"
        );
    }

    #[test]
    fn a_character_split_across_tokens_is_printed_once_whole_and_revised_text_is_held_back() {
        let mut s = Stream::default();
        assert_eq!(s.advance("caf", false).as_deref(), Some("caf"));
        // é's first byte alone decodes as U+FFFD: held back, not printed as one.
        assert_eq!(s.advance("caf\u{FFFD}", false).as_deref(), Some(""));
        assert_eq!(s.advance("café", false).as_deref(), Some("é"));
        assert_eq!(
            s.advance("café \u{FFFD}", true).as_deref(),
            Some(" \u{FFFD}"),
            "the last token's U+FFFD is the text's"
        );
        let mut s = Stream::default();
        assert_eq!(s.advance("a ,", false).as_deref(), Some("a ,"));
        assert_eq!(s.advance("a, b", false), None, "a decode that revises printed text prints nothing");
        assert_eq!(s.advance("a , b", false).as_deref(), Some(" b"));
    }

    #[test]
    fn the_continuation_ends_before_the_end_of_document_token_and_streams_what_it_drew() {
        let drawn = [7, 8, 2, 9, 10];
        let run = |stop_at: Option<i64>, max: usize| {
            let mut parts = Vec::new();
            let whole = generate(
                vec![1],
                max,
                stop_at,
                &Codec::Ids(None),
                |ids, _| Ok(drawn[ids.len() - 1]),
                &mut |p| {
                    parts.push(p.to_string());
                    Ok(true)
                },
            )
            .unwrap();
            (whole, parts)
        };
        let (whole, parts) = run(Some(2), 5);
        assert_eq!(whole, "7 8");
        assert_eq!(parts, ["7", " 8"], "each token's text as it was drawn");
        assert_eq!(run(None, 5).0, "7 8 2 9 10", "--ignore-eos draws on");
        assert_eq!(run(Some(2), 1).0, "7", "max_tokens still bounds it");
        // A reader gone: drawing stops at the first part it did not take.
        let mut draws = 0;
        let whole = generate(
            vec![1],
            5,
            None,
            &Codec::Ids(None),
            |_, _| {
                draws += 1;
                Ok(3)
            },
            &mut |_| Ok(false),
        )
        .unwrap();
        assert_eq!((whole.as_str(), draws), ("3", 1));
    }

    #[test]
    fn picks_follow_temperature_and_top_k() {
        let l = [0.0, 2.0, 1.0, 2.0];
        assert_eq!(pick(&l, 0.0, 0, 0.99), 1, "arg-max, lower id on ties");
        assert_eq!(pick(&l, 1.0, 1, 0.99), 1, "top-1 is the arg-max");
        // Two equal best: top-2 splits the mass evenly between ids 1 and 3.
        assert_eq!(pick(&l, 1.0, 2, 0.49), 1);
        assert_eq!(pick(&l, 1.0, 2, 0.51), 3);
        // All four at temperature 1: the last bucket is id 0 (the smallest logit).
        assert_eq!(pick(&l, 1.0, 0, 0.999), 0);
        // A very low temperature is nearly the arg-max even at u close to 1.
        assert_eq!(pick(&[0.0, 1.0, 5.0], 0.01, 0, 0.999_999), 2);
    }
}
