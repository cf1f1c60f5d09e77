//! Hugging Face `transformers` directories: `trainguard export --hf` writes `config.json`,
//! `model.safetensors`, `generation_config.json` and the run's tokenizer files; `import` reads
//! such a directory back as a model config and trainguard-named weights (`init_from`,
//! `sample`). Each architecture's names, layouts and `config.json` live in its own file
//! (`gpt2`, `llama`) as a [`Family`]; [`FAMILIES`] is the one place that chooses by
//! `model.arch` (export) or `model_type` (import). Owns the files and the checks (architecture,
//! sizes, every tensor's shape); not the model.
pub mod gpt2;
pub mod llama;

use crate::config::{Arch, ModelConfig};
use crate::model::Model;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// One architecture's side of the mapping.
pub struct Family {
    pub arch: Arch,
    /// `model_type` in `config.json`.
    pub model_type: &'static str,
    /// trainguard parameter name → `transformers` name, and whether the layout is transposed.
    pub hf_name: fn(&str) -> (String, bool),
    /// `transformers` tensor name → trainguard name; None: not a parameter (tied head, buffer).
    pub from_hf: fn(&str, &ModelConfig) -> Option<String>,
    /// `config.json` for a model, without the special tokens' ids (the export adds them).
    pub config_json: fn(&ModelConfig) -> Value,
    /// `config.json` (at the path, for messages) → the model config, or what does not fit.
    pub model_config: fn(&Value, &Path) -> Result<ModelConfig, HfError>,
    /// Tensors `transformers` expects that a model of this config lacks (written as zeros).
    pub zero_tensors: fn(&ModelConfig) -> Vec<(String, i64)>,
    /// `model.<key>` → the `config.json` key it is read from, for messages.
    pub config_keys: &'static [(&'static str, &'static str)],
}

pub const FAMILIES: [Family; 2] = [gpt2::FAMILY, llama::FAMILY];

fn family(arch: Arch) -> &'static Family {
    FAMILIES.iter().find(|f| f.arch == arch).expect("every architecture has a Hugging Face family")
}

#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// The directory, its config or a tensor does not fit (exit 2).
    #[error("{path}: {message}")]
    Input { path: PathBuf, message: String },
    #[error("cannot write {path}: {message}")]
    Write { path: PathBuf, message: String },
}

pub fn is_usage(cause: &(dyn std::error::Error + 'static)) -> bool {
    matches!(cause.downcast_ref::<HfError>(), Some(HfError::Input { .. }))
}

/// What `save_pretrained` writes beside the shards of a model over its `max_shard_size`.
const SHARD_INDEX: &str = "model.safetensors.index.json";

fn bad(path: &Path, message: impl Into<String>) -> HfError {
    HfError::Input { path: path.into(), message: message.into() }
}

/// A warning about a directory, said once in the process: `init_from` reads its `config.json`
/// at the check before the run starts and again at the load.
fn warn_once(message: String) {
    static SAID: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut said = SAID.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if !said.contains(&message) {
        tracing::warn!("{message}");
        said.push(message);
    }
}

/// `config.json`'s `key`, a size or count: a whole number, so -1 or 2.5 is named as given.
fn whole(c: &Value, key: &str, cpath: &Path) -> Result<usize, HfError> {
    match &c[key] {
        Value::Null => Err(bad(cpath, format!("`{key}` is missing (a whole number)"))),
        v if v.as_i64().is_some_and(|n| n < 0) => {
            Err(bad(cpath, format!("`{key}` is {v}: a size or count, so not below 0")))
        }
        v => v
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| bad(cpath, format!("`{key}` is {v}, not a whole number"))),
    }
}

/// `config.json`'s `key`, a switch that may be left out (None), but not given as another type:
/// transformers refuses `"tie_word_embeddings": "no"`, which read as absent would be false.
fn switch(c: &Value, key: &str, cpath: &Path) -> Result<Option<bool>, HfError> {
    match &c[key] {
        Value::Null => Ok(None),
        Value::Bool(b) => Ok(Some(*b)),
        v => Err(bad(cpath, format!("`{key}` is {v}, not true or false"))),
    }
}

/// The tokenizer an export carries: its tokenizer.json (one that loads), the token that ends
/// documents, and the other special tokens its own directory names.
pub struct Tokenizer<'a> {
    pub file: &'a Path,
    pub eos_token: &'a str,
    pub eos_id: u32,
    pub specials: &'a Specials,
}

impl Tokenizer<'_> {
    /// The start token (tokenizer_config.json's) and its id (config.json's): the directory's
    /// own, else the EOS (a prepared dataset's documents begin after one, as GPT-2's do).
    fn bos(&self) -> (&str, u32) {
        (
            self.specials.bos_token.as_deref().unwrap_or(self.eos_token),
            self.specials.bos_id.unwrap_or(self.eos_id),
        )
    }
}

/// The start and unknown tokens a `transformers` directory names, carried through a re-export
/// of it, each file's as it was; a prepared dataset has none.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Specials {
    /// tokenizer_config.json's `bos_token` (what `AutoTokenizer` reads), else the token of
    /// config.json's id.
    pub bos_token: Option<String>,
    /// config.json's `bos_token_id` (what `generate` reads), else the id of tokenizer_config's token.
    pub bos_id: Option<u32>,
    pub unk: Option<String>,
}

/// `dir`'s JSON file `file` (config.json, tokenizer_config.json); Null when absent or not JSON.
fn read_json(dir: &Path, file: &str) -> Value {
    crate::fs::whole_file::read_regular_string(&dir.join(file))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .unwrap_or(Value::Null)
}

/// The token tokenizer_config.json (`tc`) names under `key`: a string, or an added-token object
/// with its `content`.
fn named_token(tc: &Value, key: &str) -> Option<String> {
    tc[key].as_str().or(tc[key]["content"].as_str()).map(str::to_string)
}

/// The `eos_token` of a `transformers` directory's tokenizer_config.json.
pub fn exported_eos(dir: &Path) -> Option<String> {
    named_token(&read_json(dir, "tokenizer_config.json"), "eos_token")
}

/// [`Specials`] of the directory `dir`, whose tokenizer.json `tokenizer` is. Each counts only as
/// a token of that tokenizer; absent or unknown to it, the EOS stands for it as before.
pub fn specials(dir: &Path, tokenizer: &tokenizers::Tokenizer) -> Specials {
    let (tc, config) = (read_json(dir, "tokenizer_config.json"), read_json(dir, "config.json"));
    let token = |key: &str| named_token(&tc, key).filter(|t| tokenizer.token_to_id(t).is_some());
    let named = token("bos_token");
    let id = config["bos_token_id"]
        .as_u64()
        .and_then(|id| u32::try_from(id).ok())
        .filter(|id| tokenizer.id_to_token(*id).is_some());
    Specials {
        bos_token: named.clone().or_else(|| id.and_then(|id| tokenizer.id_to_token(id))),
        bos_id: id.or_else(|| named.and_then(|t| tokenizer.token_to_id(&t))),
        unk: token("unk_token"),
    }
}

/// Writes `model` (its weights in trainguard's names) as a `transformers` directory of its family,
/// with `tokenizer`'s files when given. Each file is
/// written into a staging directory inside `out` and moved into place once all are written,
/// `config.json` last: an export that fails (a full disk) leaves neither half a model nor a file
/// that would refuse the retry.
pub fn export(model: &Model, tokenizer: Option<Tokenizer>, out: &Path) -> Result<Vec<String>, HfError> {
    let werr =
        |p: &Path, e: &dyn std::fmt::Display| HfError::Write { path: p.into(), message: e.to_string() };
    if out.exists() && !out.is_dir() {
        return Err(bad(out, "is a file, not a directory; give a directory (a new one is created)"));
    }
    if !out.exists() && out.symlink_metadata().is_ok() {
        return Err(bad(out, "is a symbolic link to nothing; give a directory (a new one is created), or make the link's target"));
    }
    // Any model there (another format's weights beside their config.json included) stays whole,
    // and no file of the user's is replaced by one of the export's names.
    if let Some(held) = ["model.safetensors", "config.json"].iter().find(|f| out.join(f).exists()) {
        return Err(bad(out, format!("already holds {held}: a model; choose another directory")));
    }
    if let Some(held) = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
        .iter()
        .find(|f| out.join(f).exists())
    {
        return Err(bad(
            out,
            format!("already holds {held}, which the export would replace; choose another directory"),
        ));
    }
    let created = !out.exists();
    std::fs::create_dir_all(out).map_err(|e| werr(out, &e))?;
    let staging = out.join(format!(".export-{}", std::process::id()));
    let written = std::fs::create_dir(&staging)
        .map_err(|e| werr(&staging, &e))
        .and_then(|_| write_files(model, tokenizer, &staging, out));
    let moved = written.and_then(|mut files| {
        // config.json names the directory a model for transformers, and for a retry: last.
        files.sort_by_key(|f| f == "config.json");
        for f in &files {
            std::fs::rename(staging.join(f), out.join(f)).map_err(|e| werr(&out.join(f), &e))?;
        }
        Ok(files)
    });
    let _ = std::fs::remove_dir_all(&staging);
    if moved.is_err() && created {
        let _ = std::fs::remove_dir(out); // only when empty: nothing of the user's is removed
    }
    moved
}

/// The export's files, written in `staging`; errors name each file where it was to go, in `out`.
fn write_files(
    model: &Model,
    tokenizer: Option<Tokenizer>,
    staging: &Path,
    out: &Path,
) -> Result<Vec<String>, HfError> {
    let werr = |file: &str, e: &dyn std::fmt::Display| HfError::Write {
        path: out.join(file),
        message: e.to_string(),
    };
    let json_file = |file: &str, v: &Value| {
        std::fs::write(
            staging.join(file),
            serde_json::to_string_pretty(v).expect("JSON values serialise") + "\n",
        )
        .map_err(|e| werr(file, &e))
    };
    let cfg = &model.cfg;
    let fam = family(cfg.arch);
    let _no_grad = tch::no_grad_guard();
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    for (i, name) in model.params.names.iter().enumerate() {
        let (hf, transposed) = (fam.hf_name)(name);
        // The user's vocabulary rows: transformers sees `vocab_size`, not the padding.
        let t = model
            .user_tensor(i)
            .map_err(|e| werr("model.safetensors", &e))?
            .to_device(Device::Cpu)
            .to_kind(Kind::Float);
        tensors.push((hf, if transposed { t.tr().contiguous() } else { t.contiguous() }));
    }
    for (name, n) in (fam.zero_tensors)(cfg) {
        tensors.push(((fam.hf_name)(&name).0, Tensor::zeros([n], (Kind::Float, Device::Cpu))));
    }
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Tensor::write_safetensors(&refs, staging.join("model.safetensors"))
        .map_err(|e| werr("model.safetensors", &crate::checkpoint::write_error(&e)))?;

    let (bos, eos) = (tokenizer.as_ref().map(|t| t.bos().1), tokenizer.as_ref().map(|t| t.eos_id));
    let mut written =
        vec!["config.json".to_string(), "model.safetensors".into(), "generation_config.json".into()];
    let mut config = (fam.config_json)(cfg);
    config["bos_token_id"] = json!(bos);
    config["eos_token_id"] = json!(eos);
    json_file("config.json", &config)?;
    json_file(
        "generation_config.json",
        &json!({"_from_model_config": true, "bos_token_id": bos, "eos_token_id": eos}),
    )?;
    if let Some(t) = tokenizer {
        std::fs::copy(t.file, staging.join("tokenizer.json")).map_err(|e| werr("tokenizer.json", &e))?;
        let tc = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": t.bos().0, "eos_token": t.eos_token, "unk_token": t.specials.unk.as_deref().unwrap_or(t.eos_token),
            "model_max_length": cfg.seq_len,
        });
        json_file("tokenizer_config.json", &tc)?;
        written.extend(["tokenizer.json".into(), "tokenizer_config.json".into()]);
    }
    Ok(written)
}

/// Reads a `transformers` directory of a supported family: its model config and its weights
/// in trainguard's names and layouts.
pub fn import(dir: &Path) -> Result<(ModelConfig, Vec<(String, Tensor)>), HfError> {
    // The weights against the directory's own config.json, from the safetensors header, before
    // the model it describes is built: a size edited by hand would be an allocation that size.
    let (fam, cfg) = read_config(dir)?;
    check_weights(dir, fam, &cfg, &cfg)?;
    let weights = read_weights(dir, fam, &cfg)?;
    Ok((cfg, weights))
}

/// `dir`'s weights, of the family and model its `config.json` gave, in trainguard's names and
/// layouts (fp32).
fn read_weights(dir: &Path, fam: &Family, cfg: &ModelConfig) -> Result<Vec<(String, Tensor)>, HfError> {
    let wpath = dir.join("model.safetensors");
    let raw = crate::checkpoint::store::read_model_file(&wpath).map_err(|m| bad(&wpath, m))?;
    let weights = raw
        .into_iter()
        .filter_map(|(n, t)| {
            let name = (fam.from_hf)(&n, cfg)?;
            let t = t.to_kind(Kind::Float);
            let t = if (fam.hf_name)(&name).1 { t.tr().contiguous() } else { t };
            Some((name, t))
        })
        .collect();
    Ok(weights)
}

/// `dir`'s `config.json`: its family and the model config it describes, within the rules and
/// bounds a `model:` section obeys.
fn read_config(dir: &Path) -> Result<(&'static Family, ModelConfig), HfError> {
    let cpath = dir.join("config.json");
    if !cpath.is_file() {
        return Err(bad(dir, "is not a Hugging Face model directory (no config.json)"));
    }
    let text = crate::fs::whole_file::read_regular_string(&cpath).map_err(|e| bad(&cpath, e.to_string()))?;
    let c: Value = serde_json::from_str(&text).map_err(|e| bad(&cpath, e.to_string()))?;
    let fam = FAMILIES.iter().find(|f| c["model_type"] == f.model_type).ok_or_else(|| {
        let known: Vec<&str> = FAMILIES.iter().map(|f| f.model_type).collect();
        bad(&cpath, format!("model_type {} is not supported ({} are)", c["model_type"], known.join(", ")))
    })?;
    let cfg = (fam.model_config)(&c, &cpath)?;
    // An impossible shape or a size with extra digits is refused here, not met as a libtorch
    // error (or an allocation of terabytes).
    let config = crate::config::Config { model: cfg.clone(), ..Default::default() };
    let problems: Vec<String> = crate::config::validate(&config)
        .into_iter()
        .filter_map(|p| {
            let ours = p.key.strip_prefix("model.")?;
            let theirs = fam.config_keys.iter().find(|(o, _)| *o == ours).map_or(ours, |(_, t)| t);
            Some(format!("`{theirs}` ({}): {}", p.key, p.message))
        })
        .collect();
    if !problems.is_empty() {
        return Err(bad(
            &cpath,
            format!("describes a model trainguard cannot build: {}", problems.join("; ")),
        ));
    }
    Ok((fam, cfg))
}

/// Checks `dir` as `init_from` for the model `cfg` describes, before it is built, from its
/// `config.json` and the safetensors header (the file is mapped; of the tensors' data only a
/// bias the model lacks is read, to see that it is zero): everything that refuses the weights
/// (another family, head count, shape, dtype, a tensor with no place) refuses the run before
/// its directory is touched.
pub fn check_init(cfg: &ModelConfig, dir: &Path) -> Result<(), HfError> {
    checked_init(cfg, dir).map(|_| ())
}

/// [`check_init`], giving the family and model the directory's `config.json` describes.
fn checked_init(cfg: &ModelConfig, dir: &Path) -> Result<(&'static Family, ModelConfig), HfError> {
    let (fam, theirs) = read_config(dir)?;
    check_weights(dir, fam, &theirs, cfg)?;
    Ok((fam, theirs))
}

/// `dir`'s weights (and `theirs`, the model its `config.json` of family `fam` describes) fit
/// the model `cfg` describes, from the safetensors header.
fn check_weights(dir: &Path, fam: &Family, theirs: &ModelConfig, cfg: &ModelConfig) -> Result<(), HfError> {
    let (wpath, cpath) = (dir.join("model.safetensors"), dir.join("config.json"));
    if theirs.arch != cfg.arch {
        return Err(bad(
            &cpath,
            format!("holds a {:?} model; model.arch is {:?}", theirs.arch, cfg.arch).to_lowercase(),
        ));
    }
    // What no tensor's shape shows but the logits depend on: the same weights under another
    // head count, RoPE base or norm epsilon compute another model.
    let ours = cfg;
    let mut compared = vec![
        ("n_head", theirs.n_head.to_string(), ours.n_head.to_string()),
        ("n_kv_head", theirs.kv_heads().to_string(), ours.kv_heads().to_string()),
    ];
    if ours.arch == Arch::Llama {
        compared.push(("rope_theta", theirs.rope_theta.to_string(), ours.rope_theta.to_string()));
        compared.push(("norm_eps", theirs.norm_eps.to_string(), ours.norm_eps.to_string()));
        // Tied there, a head of its own here: the file holds no head for it (transformers ties
        // it on load); said so, not as a tensor missing.
        compared.push(("tie_embeddings", theirs.tie_embeddings.to_string(), ours.tie_embeddings.to_string()));
    }
    if let Some((key, t, o)) = compared.into_iter().find(|(_, t, o)| t != o) {
        return Err(bad(
            &cpath,
            format!("gives {key} {t}; the config's model.{key} is {o}: set it to {t} to load these weights"),
        ));
    }
    if !wpath.exists() && dir.join(SHARD_INDEX).is_file() {
        return Err(bad(dir, format!("holds its weights in shards ({SHARD_INDEX}); trainguard reads one model.safetensors: save it unsharded first (transformers: `model.save_pretrained(dir, max_shard_size=\"1000GB\")`)")));
    }
    let (file, _) = crate::fs::whole_file::open_regular(&wpath).map_err(|e| bad(&wpath, e.to_string()))?;
    let map = crate::ffi::os::map_readonly(&file).map_err(|e| bad(&wpath, e.to_string()))?;
    let header = safetensors::SafeTensors::deserialize(&map)
        .map_err(|e| bad(&wpath, crate::checkpoint::store::not_whole(&e)))?;
    // trainguard's names, sorted: the first tensor without a place is the same on every run.
    let mut views: Vec<(String, safetensors::tensor::TensorView)> =
        header.tensors().into_iter().filter_map(|(n, v)| Some(((fam.from_hf)(&n, theirs)?, v))).collect();
    views.sort_by(|a, b| a.0.cmp(&b.0));
    use safetensors::Dtype::{BF16, F16, F32, F64};
    if let Some((name, view)) = views.iter().find(|(_, v)| !matches!(v.dtype(), BF16 | F16 | F32 | F64)) {
        return Err(bad(
            &wpath,
            format!(
                "`{}` is {:?}; weights are floating point (F32, F16, BF16 or F64)",
                (fam.hf_name)(name).0,
                view.dtype()
            ),
        ));
    }
    let specs = crate::model::describe(cfg);
    if let Some(why) = untied_head(&header, fam, theirs, &specs) {
        return Err(bad(&wpath, why));
    }
    for s in &specs {
        let hf = (fam.hf_name)(&s.name).0;
        let view = views
            .iter()
            .find(|(n, _)| *n == s.name)
            .map(|(_, v)| v)
            .ok_or_else(|| bad(&wpath, format!("no tensor `{hf}`")))?;
        // transformers' vocabulary matrices have the user's rows; the model pads them.
        let got: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        if hf_shape(fam, &s.name, &got) != s.user_shape() {
            return Err(bad(
                &wpath,
                format!(
                    "`{hf}` has shape {got:?}; the model (its config) needs {:?}",
                    hf_shape(fam, &s.name, &s.user_shape())
                ),
            ));
        }
    }
    let names: Vec<&str> = views.iter().map(|(n, _)| n.as_str()).collect();
    let is_zero = |i: usize| {
        let v = &views[i].1;
        let shape: Vec<i64> = v.shape().iter().map(|&d| d as i64).collect();
        let kind = Kind::try_from(v.dtype()).ok();
        kind.and_then(|k| Tensor::f_from_data_size(v.data(), &shape, k).ok()).is_some_and(|t| is_all_zero(&t))
    };
    if let Some(why) = unplaced_in(cfg, |name| specs.iter().any(|s| s.name == name), &names, is_zero) {
        return Err(bad(&wpath, why));
    }
    // The weights fit `cfg`'s model; the config.json beside them must give its sizes too (it
    // describes the directory to transformers, and to `sample` and `export` here).
    let mut sizes = vec![
        ("n_layer", theirs.n_layer, cfg.n_layer),
        ("n_embd", theirs.n_embd, cfg.n_embd),
        ("vocab_size", theirs.vocab_size, cfg.vocab_size),
        ("ffn_hidden", theirs.ffn(), cfg.ffn()),
    ];
    if cfg.arch == Arch::Gpt2 {
        sizes.push(("seq_len", theirs.seq_len, cfg.seq_len)); // the position embedding's rows
    }
    if let Some((key, said, held)) = sizes.into_iter().find(|(_, t, o)| t != o) {
        let theirs_key = fam.config_keys.iter().find(|(o, _)| *o == key).map_or(key, |(_, t)| t);
        return Err(bad(
            &cpath,
            format!("gives `{theirs_key}` {said}; the weights beside it have {held} (model.{key})"),
        ));
    }
    Ok(())
}

/// A `lm_head.weight` stored beside the embedding that `config.json` ties it to, with other
/// values: transformers then keeps both (it warns and does not tie them), and loading the
/// embedding alone, as a tied model does, would compute another model. An exporter's copy of
/// the embedding, the same to the bit, is what tying means and passes.
fn untied_head(
    header: &safetensors::SafeTensors,
    fam: &Family,
    theirs: &ModelConfig,
    specs: &[crate::model::TensorSpec],
) -> Option<String> {
    const HEAD: &str = "lm_head.weight";
    let head = header.tensor(HEAD).ok().filter(|_| (fam.from_hf)(HEAD, theirs).is_none())?;
    let ours = &specs.iter().find(|s| s.part == crate::model::Part::TiedEmbedding)?.name;
    // Under transformers' name, or ours (the Hub's GPT-2 has no `transformer.` prefix).
    let (embed_name, embed) = [(fam.hf_name)(ours).0, ours.clone()]
        .into_iter()
        .find_map(|n| header.tensor(&n).ok().map(|t| (n, t)))?;
    let same = head.dtype() == embed.dtype() && head.shape() == embed.shape() && head.data() == embed.data();
    let fix = match theirs.arch {
        Arch::Gpt2 => "trainguard's GPT-2 ties its head to the embedding, so it cannot build this model",
        Arch::Llama => "set `tie_word_embeddings` to false in config.json (and model.tie_embeddings: false) to load the head",
    };
    (!same).then(|| format!("holds `{HEAD}`, other values than `{embed_name}`, which config.json ties it to (`tie_word_embeddings`); transformers would keep both: {fix}"))
}

/// `init_from`: copies `dir`'s weights into `model`, checked as [`check_init`] checks them.
/// (Read here, at the load, and not at the check before the run started: held through the
/// run's set-up they would sit inside the baseline a CPU `memory.limit` is measured above.)
pub fn init_from(model: &Model, dir: &Path) -> Result<(), HfError> {
    let (fam, theirs) = checked_init(&model.cfg, dir)?;
    let weights = read_weights(dir, fam, &theirs)?;
    let wpath = dir.join("model.safetensors");
    let _no_grad = tch::no_grad_guard();
    for (i, name) in model.params.names.iter().enumerate() {
        // Changed on disk since the check: its tensor may have gone.
        let src = weights.iter().find(|(n, _)| n == name).map(|(_, t)| t).ok_or_else(|| {
            bad(&wpath, format!("no tensor `{}`", (family(model.cfg.arch).hf_name)(name).0))
        })?;
        model.copy_user_tensor(i, src).map_err(|e| bad(&wpath, e))?;
    }
    Ok(())
}

/// The first of `weights` the model has no parameter for, and why (a bias the model lacks is
/// dropped when it is zero): loading the rest would compute another model than the directory's.
pub fn unplaced(model: &Model, weights: &[(String, Tensor)]) -> Option<String> {
    let names: Vec<&str> = weights.iter().map(|(n, _)| n.as_str()).collect();
    unplaced_in(&model.cfg, |name| model.params.get(name).is_some(), &names, |i| is_all_zero(&weights[i].1))
}

/// [`unplaced`] for the model `cfg` describes: `has` says which names it has, `is_zero` whether
/// the tensor `names[i]` is all zeros.
fn unplaced_in(
    cfg: &ModelConfig,
    has: impl Fn(&str) -> bool,
    names: &[&str],
    is_zero: impl Fn(usize) -> bool,
) -> Option<String> {
    let i = (0..names.len()).find(|&i| !(has(names[i]) || names[i].ends_with(".bias") && is_zero(i)))?;
    let name = names[i];
    let block = name.split('.').find_map(|s| s.parse::<usize>().ok());
    let why = match block {
        Some(i) if i >= cfg.n_layer => format!("block {i} is beyond model.n_layer = {}", cfg.n_layer),
        _ if name.ends_with(".bias") => "a non-zero bias, and model.bias is false".into(),
        _ if name.contains("lm_head") => "an output head of its own, and model.tie_embeddings is true".into(),
        _ => "the model has no such parameter".into(),
    };
    Some(format!("`{}` has no place in the model: {why}", (family(cfg.arch).hf_name)(name).0))
}

fn is_all_zero(t: &Tensor) -> bool {
    t.numel() == 0 || t.abs().max().double_value(&[]) == 0.0
}

/// A shape as `transformers` writes the tensor (Conv1D weights transposed).
fn hf_shape(fam: &Family, name: &str, shape: &[i64]) -> Vec<i64> {
    if (fam.hf_name)(name).1 {
        shape.iter().rev().copied().collect()
    } else {
        shape.to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exports_eos_token_is_read_as_a_name_or_an_added_token() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(exported_eos(d.path()), None);
        let config = d.path().join("tokenizer_config.json");
        std::fs::write(&config, r#"{"eos_token": "[SEP]"}"#).unwrap();
        assert_eq!(exported_eos(d.path()).as_deref(), Some("[SEP]"));
        std::fs::write(&config, r#"{"eos_token": {"content": "</s>", "special": true}}"#).unwrap();
        assert_eq!(exported_eos(d.path()).as_deref(), Some("</s>"));
    }

    fn cfg(bias: bool) -> ModelConfig {
        ModelConfig {
            bias,
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            vocab_size: 40,
            seq_len: 8,
            ..ModelConfig::default()
        }
    }

    #[test]
    fn export_then_init_from_is_bit_exact_and_shapes_are_checked() {
        for bias in [true, false] {
            let d = tempfile::tempdir().unwrap();
            let a = Model::new(&cfg(bias), 1, Device::Cpu).unwrap();
            export(&a, None, &d.path().join("hf")).unwrap();
            let b = Model::new(&cfg(bias), 2, Device::Cpu).unwrap();
            init_from(&b, &d.path().join("hf")).unwrap();
            for (x, y) in a.params.tensors.iter().zip(&b.params.tensors) {
                assert!(x.equal(y));
            }
            let raw = Tensor::read_safetensors(d.path().join("hf/model.safetensors")).unwrap();
            let qkv = raw.iter().find(|(n, _)| n == "transformer.h.0.attn.c_attn.weight").unwrap();
            assert_eq!(qkv.1.size(), [16, 48], "Conv1D layout [in, out]");
            // Refused from the config alone, before any model is built.
            let e = check_init(&ModelConfig { n_embd: 32, ..cfg(bias) }, &d.path().join("hf"))
                .err()
                .unwrap()
                .to_string();
            assert!(
                e.contains(
                    "`transformer.wte.weight` has shape [40, 16]; the model (its config) needs [40, 32]"
                ),
                "{e}"
            );
        }
    }

    /// A GPT-2 with biases exported into `hf` of a temporary directory (kept alive by the first).
    fn exported_gpt() -> (tempfile::TempDir, std::path::PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let hf = d.path().join("hf");
        export(&Model::new(&cfg(true), 1, Device::Cpu).unwrap(), None, &hf).unwrap();
        (d, hf)
    }

    #[test]
    fn nan_weights_a_file_cut_short_and_shards_are_refused_by_what_is_wrong() {
        let (_d, hf) = exported_gpt();
        let path = hf.join("model.safetensors");
        let mut raw = Tensor::read_safetensors(&path).unwrap();
        let (name, t) = raw.iter_mut().find(|(n, _)| n == "transformer.h.0.mlp.c_fc.weight").unwrap();
        let _ = t.get(0).get(0).f_fill_(f64::INFINITY).unwrap();
        let name = name.clone();
        Tensor::write_safetensors(&raw, &path).unwrap();
        let e = import(&hf).unwrap_err().to_string();
        assert!(
            e.contains(&format!("`{name}` in model.safetensors holds 1 of")) && e.contains("NaN or infinite"),
            "{e}"
        );
        let model = Model::new(&cfg(true), 2, Device::Cpu).unwrap();
        assert!(init_from(&model, &hf).unwrap_err().to_string().contains("NaN or infinite"));
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
        let e = check_init(&cfg(true), &hf).unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors: not a whole safetensors file (cut short, or another format)"),
            "{e}"
        );
        std::fs::remove_file(&path).unwrap();
        std::fs::write(hf.join(SHARD_INDEX), "{}").unwrap();
        let e = import(&hf).unwrap_err().to_string();
        assert!(
            e.contains("holds its weights in shards (model.safetensors.index.json)")
                && e.contains("max_shard_size"),
            "{e}"
        );
    }

    #[test]
    fn half_precision_weights_load_and_what_has_no_place_or_is_not_a_float_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let hf = d.path().join("hf");
        let a = Model::new(&cfg(true), 1, Device::Cpu).unwrap();
        export(&a, None, &hf).unwrap();
        let path = hf.join("model.safetensors");
        let raw = Tensor::read_safetensors(&path).unwrap();
        let rewrite = |f: &dyn Fn(&str, &Tensor) -> Tensor| {
            let t: Vec<(String, Tensor)> = raw.iter().map(|(n, t)| (n.clone(), f(n, t))).collect();
            Tensor::write_safetensors(&t, &path).unwrap();
        };
        let zero_biases =
            |n: &str, t: &Tensor| if n.ends_with(".bias") { t.zeros_like() } else { t.shallow_clone() };
        // bf16 weights, into a model without biases: the zero biases are dropped.
        rewrite(&|n, t| zero_biases(n, t).to_kind(Kind::BFloat16));
        let b = Model::new(&cfg(false), 2, Device::Cpu).unwrap();
        init_from(&b, &hf).unwrap();
        for (i, name) in b.params.names.iter().enumerate() {
            let j = a.params.names.iter().position(|n| n == name).unwrap();
            assert!(
                b.user_tensor(i)
                    .unwrap()
                    .equal(&a.user_tensor(j).unwrap().to_kind(Kind::BFloat16).to_kind(Kind::Float)),
                "{name}"
            );
        }
        // One bias not zero: read from the mapped file, and refused by name.
        rewrite(&|n, t| if n == "transformer.h.1.mlp.c_fc.bias" { t.ones_like() } else { zero_biases(n, t) });
        let e = check_init(&cfg(false), &hf).unwrap_err().to_string();
        assert!(e.contains("`transformer.h.1.mlp.c_fc.bias` has no place in the model: a non-zero bias, and model.bias is false"), "{e}");
        check_init(&cfg(true), &hf).unwrap();
        rewrite(&|n, t| {
            if n == "transformer.wpe.weight" {
                t.to_kind(Kind::Int64)
            } else {
                t.shallow_clone()
            }
        });
        let e = check_init(&cfg(true), &hf).unwrap_err().to_string();
        assert!(e.contains("`transformer.wpe.weight` is I64; weights are floating point"), "{e}");
        // A bias the model lacks that is not a float is named for its dtype, not as "non-zero".
        rewrite(&|n, t| {
            if n == "transformer.h.0.attn.c_proj.bias" {
                t.zeros_like().to_kind(Kind::Int64)
            } else {
                zero_biases(n, t)
            }
        });
        let e = check_init(&cfg(false), &hf).unwrap_err().to_string();
        assert!(e.contains("`transformer.h.0.attn.c_proj.bias` is I64; weights are floating point"), "{e}");
    }

    #[test]
    fn llama_export_then_init_from_is_bit_exact_tied_or_not_and_refuses_another_arch() {
        let d = tempfile::tempdir().unwrap();
        for tie in [true, false] {
            let c = ModelConfig {
                arch: Arch::Llama,
                n_kv_head: Some(1),
                ffn_hidden: Some(24),
                bias: false,
                tie_embeddings: tie,
                ..cfg(false)
            };
            let hf = d.path().join(format!("hf-{tie}"));
            let a = Model::new(&c, 1, Device::Cpu).unwrap();
            export(&a, None, &hf).unwrap();
            let names: Vec<String> = Tensor::read_safetensors(hf.join("model.safetensors"))
                .unwrap()
                .into_iter()
                .map(|(n, _)| n)
                .collect();
            assert_eq!(names.contains(&"lm_head.weight".to_string()), !tie, "a tied head is not written");
            assert_eq!(names.len(), a.params.names.len());
            let (back, _) = import(&hf).unwrap();
            assert_eq!(back, c);
            let b = Model::new(&c, 2, Device::Cpu).unwrap();
            init_from(&b, &hf).unwrap();
            for (x, y) in a.params.tensors.iter().zip(&b.params.tensors) {
                assert!(x.equal(y));
            }
        }
        let e = check_init(&cfg(true), &d.path().join("hf-true")).err().unwrap().to_string();
        assert!(e.contains("holds a llama model; model.arch is gpt2"), "{e}");
    }

    /// The Hub's GPT-2 layout (`openai-community/gpt2`): names without `transformer.`, and each
    /// block's causal mask buffers, which transformers does not load: they load here too.
    #[test]
    fn a_gpt2_directory_laid_out_as_the_hubs_loads() {
        let d = tempfile::tempdir().unwrap();
        let (c, hf) = (cfg(true), d.path().join("hub"));
        let a = Model::new(&c, 1, Device::Cpu).unwrap();
        export(&a, None, &hf).unwrap();
        let wpath = hf.join("model.safetensors");
        let mut weights: Vec<(String, Tensor)> = Tensor::read_safetensors(&wpath)
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n.trim_start_matches("transformer.").to_string(), t))
            .collect();
        for i in 0..c.n_layer {
            let mask = Tensor::ones([c.seq_len as i64, c.seq_len as i64], (Kind::Float, Device::Cpu))
                .tril(0)
                .view([1, 1, c.seq_len as i64, c.seq_len as i64]);
            weights.push((format!("h.{i}.attn.bias"), mask));
            weights.push((format!("h.{i}.attn.masked_bias"), Tensor::from(-10000.0f32)));
        }
        let refs: Vec<(&str, &Tensor)> = weights.iter().map(|(n, t)| (n.as_str(), t)).collect();
        Tensor::write_safetensors(&refs, &wpath).unwrap();
        assert_eq!(import(&hf).unwrap().0, c);
        let b = Model::new(&c, 2, Device::Cpu).unwrap();
        init_from(&b, &hf).unwrap();
        for (x, y) in a.params.tensors.iter().zip(&b.params.tensors) {
            assert!(x.equal(y));
        }
        // A head beside `wte.weight` (unprefixed): refused unless it is the embedding's copy.
        let wte = weights.iter().find(|(n, _)| n == "wte.weight").unwrap().1.copy();
        for (head, loads) in [(&wte + 1.0, false), (wte.copy(), true)] {
            let mut with_head: Vec<(&str, &Tensor)> = refs.clone();
            with_head.push(("lm_head.weight", &head));
            Tensor::write_safetensors(&with_head, &wpath).unwrap();
            match import(&hf) {
                Ok(_) => assert!(loads, "a head of other values was dropped"),
                Err(e) => assert!(!loads && e.to_string().contains("other values than `wte.weight`"), "{e}"),
            }
        }
    }

    /// An untied head under a config.json that says tied: refused, not dropped (transformers
    /// keeps both); a head the same to the bit as the embedding is an exporter's copy and loads.
    #[test]
    fn a_head_stored_apart_from_the_embedding_it_is_tied_to_is_refused_unless_a_copy() {
        let d = tempfile::tempdir().unwrap();
        let untied = ModelConfig {
            arch: Arch::Llama,
            n_kv_head: Some(1),
            ffn_hidden: Some(24),
            bias: false,
            tie_embeddings: false,
            ..cfg(false)
        };
        let tied = ModelConfig { tie_embeddings: true, ..untied.clone() };
        let hf = d.path().join("hf");
        export(&Model::new(&untied, 1, Device::Cpu).unwrap(), None, &hf).unwrap();
        let cpath = hf.join("config.json");
        let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&cpath).unwrap()).unwrap();
        c["tie_word_embeddings"] = json!(true);
        std::fs::write(&cpath, c.to_string()).unwrap();
        for e in [import(&hf).err().unwrap().to_string(), check_init(&tied, &hf).err().unwrap().to_string()] {
            assert!(
                e.contains("holds `lm_head.weight`, other values than `model.embed_tokens.weight`")
                    && e.contains("tie_word_embeddings"),
                "{e}"
            );
        }
        let e = check_init(&untied, &hf).err().unwrap().to_string();
        assert!(
            e.contains("gives tie_embeddings true; the config's model.tie_embeddings is false"),
            "not a tensor said missing: {e}"
        );
        // The head rewritten as the embedding's copy: what tying means.
        let wpath = hf.join("model.safetensors");
        let mut weights = Tensor::read_safetensors(&wpath).unwrap();
        let embed = weights.iter().find(|(n, _)| n == "model.embed_tokens.weight").unwrap().1.copy();
        weights.iter_mut().find(|(n, _)| n == "lm_head.weight").unwrap().1 = embed;
        let refs: Vec<(&str, &Tensor)> = weights.iter().map(|(n, t)| (n.as_str(), t)).collect();
        Tensor::write_safetensors(&refs, &wpath).unwrap();
        assert_eq!(import(&hf).unwrap().0, tied);
        check_init(&tied, &hf).unwrap();
    }

    #[test]
    fn a_config_json_that_disagrees_with_its_weights_is_refused_before_a_model_is_built() {
        let (_d, hf) = exported_gpt();
        let json = hf.join("config.json");
        let good: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let edit = |key: &str, v: u64| {
            let mut c = good.clone();
            c[key] = v.into();
            std::fs::write(&json, c.to_string()).unwrap();
        };
        // Sizes that would build a model of hundreds of GiB: refused from the header.
        edit("n_embd", 131072);
        let e = import(&hf).unwrap_err().to_string();
        assert!(
            e.contains(
                "`transformer.wte.weight` has shape [40, 16]; the model (its config) needs [40, 131072]"
            ),
            "{e}"
        );
        // More blocks than the file holds: for import, a missing tensor; for init_from into
        // the model the weights fit, the config.json's own count.
        edit("n_layer", 3);
        assert!(import(&hf).unwrap_err().to_string().contains("no tensor `transformer.h.2."));
        let e = check_init(&cfg(true), &hf).unwrap_err().to_string();
        assert!(
            e.contains("config.json")
                && e.contains("gives `n_layer` 3; the weights beside it have 2 (model.n_layer)"),
            "{e}"
        );
        std::fs::write(&json, good.to_string()).unwrap();
        assert_eq!(import(&hf).unwrap().0, cfg(true));
    }
}
