//! `tokenizer_config.json` and the chat template files next to it.

use crate::{bail_model, untrusted_file, Error, Result};
use serde_json::Value as Json;
use std::path::Path;

pub const CONFIG_FILE: &str = "tokenizer_config.json";
pub const TEMPLATE_JINJA_FILE: &str = "chat_template.jinja";
pub const TEMPLATE_JSON_FILE: &str = "chat_template.json";

/// The special tokens a tokenizer config names, as strings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
    pub unk: Option<String>,
    pub sep: Option<String>,
    pub pad: Option<String>,
    pub cls: Option<String>,
    pub mask: Option<String>,
    pub additional: Vec<String>,
}

impl SpecialTokens {
    /// The set tokens under transformers' names (`bos_token`, ...), as chat templates see them.
    pub fn named(&self) -> impl Iterator<Item = (&'static str, &str)> {
        [
            ("bos_token", &self.bos),
            ("eos_token", &self.eos),
            ("unk_token", &self.unk),
            ("sep_token", &self.sep),
            ("pad_token", &self.pad),
            ("cls_token", &self.cls),
            ("mask_token", &self.mask),
        ]
        .into_iter()
        .filter_map(|(name, tok)| tok.as_deref().map(|t| (name, t)))
    }
}

/// Where the chat template comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateSource {
    None,
    /// Template text and the file it came from.
    Text {
        source: String,
        origin: String,
    },
    /// The config lists named templates but none called "default".
    NoDefault {
        names: Vec<String>,
    },
}

/// What NanoInfer uses from `tokenizer_config.json` (and the template files).
#[derive(Debug, Clone)]
pub struct TokenizerConfig {
    pub special: SpecialTokens,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub chat_template: TemplateSource,
}

fn read_text(path: &Path) -> Result<Option<String>> {
    let cap = if path.extension().is_some_and(|e| e == "jinja") {
        untrusted_file::MAX_TEMPLATE_BYTES
    } else {
        untrusted_file::MAX_CONFIG_BYTES
    };
    untrusted_file::read_text_if_exists(path, cap)
}

fn parse_json(path: &Path, text: &str) -> Result<Json> {
    serde_json::from_str(text)
        .map_err(|e| Error::invalid_model(format!("{} is not valid JSON: {e}", path.display())))
}

/// A special token is a string, an AddedToken object `{"content": ...}`, or null.
fn token_string(path: &Path, key: &str, value: &Json) -> Result<Option<String>> {
    match value {
        Json::Null => Ok(None),
        Json::String(s) => Ok(Some(s.clone())),
        Json::Object(obj) => match obj.get("content") {
            Some(Json::String(s)) => Ok(Some(s.clone())),
            _ => bail_model!(
                "{}: \"{key}\" is an object without a string \"content\"",
                path.display()
            ),
        },
        _ => bail_model!(
            "{}: \"{key}\" must be a string or an object with \"content\"",
            path.display()
        ),
    }
}

fn optional_bool(path: &Path, cfg: &Json, key: &str) -> Result<Option<bool>> {
    match cfg.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Bool(b)) => Ok(Some(*b)),
        Some(other) => bail_model!(
            "{}: \"{key}\" must be true or false, got {other}",
            path.display()
        ),
    }
}

fn parse_special(path: &Path, cfg: &Json) -> Result<SpecialTokens> {
    let get = |key: &str| match cfg.get(key) {
        Some(v) => token_string(path, key, v),
        None => Ok(None),
    };
    let additional = match cfg.get("additional_special_tokens") {
        None | Some(Json::Null) => Vec::new(),
        Some(Json::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                if let Some(tok) = token_string(path, "additional_special_tokens", item)? {
                    out.push(tok);
                }
            }
            out
        }
        Some(_) => bail_model!(
            "{}: \"additional_special_tokens\" must be a list",
            path.display()
        ),
    };
    Ok(SpecialTokens {
        bos: get("bos_token")?,
        eos: get("eos_token")?,
        unk: get("unk_token")?,
        sep: get("sep_token")?,
        pad: get("pad_token")?,
        cls: get("cls_token")?,
        mask: get("mask_token")?,
        additional,
    })
}

/// `chat_template` is a string, or a list of `{"name", "template"}` (then "default" is used).
fn parse_template(path: &Path, value: Option<&Json>) -> Result<TemplateSource> {
    let origin = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match value {
        None | Some(Json::Null) => Ok(TemplateSource::None),
        Some(Json::String(s)) => Ok(TemplateSource::Text {
            source: s.clone(),
            origin,
        }),
        Some(Json::Array(items)) => {
            let mut names = Vec::with_capacity(items.len());
            for item in items {
                let name = item.get("name").and_then(Json::as_str);
                let template = item.get("template").and_then(Json::as_str);
                let (Some(name), Some(template)) = (name, template) else {
                    bail_model!(
                        "{}: each entry of \"chat_template\" needs string \"name\" and \"template\" fields",
                        path.display()
                    );
                };
                if name == "default" {
                    let origin = format!("{origin} (template \"default\")");
                    return Ok(TemplateSource::Text {
                        source: template.to_string(),
                        origin,
                    });
                }
                names.push(name.to_string());
            }
            Ok(TemplateSource::NoDefault { names })
        }
        Some(_) => bail_model!(
            "{}: \"chat_template\" must be a string or a list of named templates",
            path.display()
        ),
    }
}

impl TokenizerConfig {
    /// Reads the config in `dir`; a missing `tokenizer_config.json` means no special
    /// tokens and no template. `chat_template.jinja` (newer transformers layout) wins
    /// over `chat_template.json`, which wins over the config's `chat_template`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join(CONFIG_FILE);
        let (special, add_bos_token, add_eos_token, mut chat_template) = match read_text(&path)? {
            None => (SpecialTokens::default(), None, None, TemplateSource::None),
            Some(text) => {
                let cfg = parse_json(&path, &text)?;
                if !cfg.is_object() {
                    bail_model!("{} must hold a JSON object", path.display());
                }
                (
                    parse_special(&path, &cfg)?,
                    optional_bool(&path, &cfg, "add_bos_token")?,
                    optional_bool(&path, &cfg, "add_eos_token")?,
                    parse_template(&path, cfg.get("chat_template"))?,
                )
            }
        };
        let json_path = dir.join(TEMPLATE_JSON_FILE);
        if let Some(text) = read_text(&json_path)? {
            let cfg = parse_json(&json_path, &text)?;
            match parse_template(&json_path, cfg.get("chat_template"))? {
                TemplateSource::None => {
                    bail_model!("{} has no \"chat_template\" field", json_path.display())
                }
                found => chat_template = found,
            }
        }
        if let Some(source) = read_text(&dir.join(TEMPLATE_JINJA_FILE))? {
            chat_template = TemplateSource::Text {
                source,
                origin: TEMPLATE_JINJA_FILE.to_string(),
            };
        }
        Ok(TokenizerConfig {
            special,
            add_bos_token,
            add_eos_token,
            chat_template,
        })
    }
}
