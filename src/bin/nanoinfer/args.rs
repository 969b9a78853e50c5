//! A small command-line parser: `--key value` options, repeatable options and
//! boolean flags, with errors that name the offending option.

use std::collections::HashMap;

pub struct Args {
    values: HashMap<String, Vec<String>>,
    flags: Vec<String>,
}

impl Args {
    /// Parses `argv`; `flag_names` lists the options that take no value.
    pub fn parse(argv: &[String], flag_names: &[&str]) -> Result<Args, String> {
        let mut values: HashMap<String, Vec<String>> = HashMap::new();
        let mut flags = Vec::new();
        let mut it = argv.iter();
        while let Some(a) = it.next() {
            let Some(name) = a.strip_prefix("--") else {
                return Err(format!("unexpected argument `{a}`"));
            };
            let (name, inline) = match name.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (name, None),
            };
            if flag_names.contains(&name) {
                flags.push(name.to_string());
                continue;
            }
            let v = match inline {
                Some(v) => v,
                None => it
                    .next()
                    .cloned()
                    .ok_or_else(|| format!("option --{name} needs a value"))?,
            };
            values.entry(name.to_string()).or_default().push(v);
        }
        Ok(Args { values, flags })
    }

    pub fn flag(&self, name: &str) -> bool {
        self.flags.iter().any(|f| f == name)
    }

    pub fn all(&self, name: &str) -> &[String] {
        self.values.get(name).map(Vec::as_slice).unwrap_or(&[])
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.all(name).last().map(String::as_str)
    }

    pub fn parse_or<T: std::str::FromStr>(&self, name: &str, default: T) -> Result<T, String>
    where
        T::Err: std::fmt::Display,
    {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v
                .parse()
                .map_err(|e| format!("invalid value `{v}` for --{name}: {e}")),
        }
    }

    /// Rejects options outside `known` (catches typos).
    pub fn check_known(&self, known: &[&str]) -> Result<(), String> {
        for k in self.values.keys().chain(self.flags.iter()) {
            if !known.contains(&k.as_str()) {
                return Err(format!("unknown option --{k}"));
            }
        }
        Ok(())
    }
}
