//! Stop strings over streamed text.
//!
//! Text that could still become the start of a stop string is held back and
//! released once it cannot. When stops overlap, the match that *completes*
//! first in the text wins (ties: the one starting first, then the lower index),
//! which makes the result independent of how the text was split into deltas.
//! Held text always starts at a char boundary: a stop string's first byte is a
//! UTF-8 lead byte, so nothing ever splits a char.

/// What `StopMatcher::push` releases.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopOutput {
    /// Text safe to emit now (on a match: everything before the stop string).
    pub text: String,
    /// Index (into the stops given to `new`) of the stop string that matched.
    pub stop: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: Option<usize>,
    max_len: usize,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they are rejected by validation).
    pub fn new(stops: &[String]) -> Self {
        let stops: Vec<String> = stops.to_vec();
        let max_len = stops.iter().map(String::len).max().unwrap_or(0);
        StopMatcher {
            stops,
            held: String::new(),
            stopped: None,
            max_len,
        }
    }

    /// Index of the stop string that matched, if any.
    pub fn stopped(&self) -> Option<usize> {
        self.stopped
    }

    /// Text currently held back.
    pub fn held(&self) -> &str {
        &self.held
    }

    /// Feeds the next piece of generated text. After a match every further
    /// push returns nothing.
    pub fn push(&mut self, delta: &str) -> StopOutput {
        if self.stopped.is_some() {
            return StopOutput::default();
        }
        if self.max_len == 0 {
            return StopOutput {
                text: delta.to_string(),
                stop: None,
            };
        }
        self.held.push_str(delta);

        if let Some((start, index)) = self.earliest_match() {
            let text = self.held[..start].to_string();
            self.held.clear();
            self.stopped = Some(index);
            return StopOutput {
                text,
                stop: Some(index),
            };
        }
        let cut = self.held.len() - self.partial_suffix_len();
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopOutput { text, stop: None }
    }

    /// Releases the held text at the end of generation (nothing after a match).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// `(start, stop index)` of the match ending first in the held text.
    fn earliest_match(&self) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize, usize)> = None; // (end, start, index)
        for (i, s) in self.stops.iter().enumerate() {
            if s.is_empty() {
                continue;
            }
            if let Some(start) = self.held.find(s.as_str()) {
                let cand = (start + s.len(), start, i);
                if best.is_none_or(|b| cand < b) {
                    best = Some(cand);
                }
            }
        }
        best.map(|(_, start, i)| (start, i))
    }

    /// Length of the longest suffix of the held text that is a proper prefix
    /// of some stop string (the part that must stay held).
    fn partial_suffix_len(&self) -> usize {
        let held = self.held.as_bytes();
        let longest = held.len().min(self.max_len.saturating_sub(1));
        (1..=longest)
            .rev()
            .find(|&n| {
                let suffix = &held[held.len() - n..];
                self.stops
                    .iter()
                    .any(|s| s.len() > n && s.as_bytes().starts_with(suffix))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::rng::Rng;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    /// Feeds the deltas, returns (all emitted text incl. flush, stop index).
    fn feed(stops: &[&str], deltas: &[&str]) -> (String, Option<usize>) {
        let mut m = matcher(stops);
        let mut out = String::new();
        for d in deltas {
            let o = m.push(d);
            out.push_str(&o.text);
            if o.stop.is_some() {
                assert_eq!(m.stopped(), o.stop);
                return (out, o.stop);
            }
        }
        out.push_str(&m.flush());
        (out, None)
    }

    #[test]
    fn no_stops_passes_through() {
        assert_eq!(feed(&[], &["ab", "c"]), ("abc".into(), None));
    }

    #[test]
    fn stop_inside_one_delta() {
        assert_eq!(
            feed(&["STOP"], &["hello STOP world"]),
            ("hello ".into(), Some(0))
        );
    }

    #[test]
    fn stop_split_across_deltas() {
        assert_eq!(
            feed(&["STOP"], &["hel", "lo ST", "OP more"]),
            ("hello ".into(), Some(0))
        );
        assert_eq!(
            feed(&["STOP"], &["hello S", "T", "O", "P"]),
            ("hello ".into(), Some(0))
        );
        assert_eq!(feed(&["</s>"], &["x<", "/", "s>y"]), ("x".into(), Some(0)));
    }

    #[test]
    fn held_text_is_released_when_match_fails() {
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("go S").text, "go ");
        assert_eq!(m.held(), "S");
        assert_eq!(m.push("T").text, "");
        assert_eq!(m.push("X").text, "STX");
        assert_eq!(m.held(), "");
    }

    #[test]
    fn flush_releases_partial_match() {
        let mut m = matcher(&["cd"]);
        assert_eq!(m.push("abc").text, "ab");
        assert_eq!(m.flush(), "c");
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn nothing_after_a_match() {
        let mut m = matcher(&["x"]);
        assert_eq!(
            m.push("axb"),
            StopOutput {
                text: "a".into(),
                stop: Some(0)
            }
        );
        assert_eq!(m.push("more"), StopOutput::default());
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn multibyte_chars_never_split() {
        assert_eq!(feed(&["é!"], &["caf", "é", "!"]), ("caf".into(), Some(0)));
        assert_eq!(
            feed(&["日本"], &["日曜", "日", "本語"]),
            ("日曜".into(), Some(0))
        );
        let mut m = matcher(&["€uro"]);
        assert_eq!(m.push("price: €").text, "price: ");
        assert_eq!(m.push("ur").text, "");
        assert_eq!(m.push("x").text, "€urx");
        // A stop sharing only a continuation byte with the text must not hold it:
        // "é" is C3 A9, "©" is C2 A9; a stop "©x" must not hold back "é".
        let mut m = matcher(&["©x"]);
        assert_eq!(m.push("é").text, "é");
    }

    #[test]
    fn overlapping_candidates() {
        assert_eq!(feed(&["abc", "bcd"], &["abcd"]), ("".into(), Some(0)));
        assert_eq!(feed(&["abc", "bcd"], &["xbcd"]), ("x".into(), Some(1)));
        assert_eq!(
            feed(&["abc", "bcd"], &["a", "b", "x", "bcd"]),
            ("abx".into(), Some(1))
        );
        assert_eq!(feed(&["aab"], &["aaab"]), ("a".into(), Some(0)));
        assert_eq!(feed(&["aab"], &["a", "a", "a", "b"]), ("a".into(), Some(0)));
        assert_eq!(feed(&["aab"], &["aa", "ab"]), ("a".into(), Some(0)));
    }

    #[test]
    fn earliest_match_wins() {
        // "lo" completes before "world" does.
        assert_eq!(
            feed(&["world", "lo"], &["hello world"]),
            ("hel".into(), Some(1))
        );
        // Same end: the longer (earlier-starting) stop wins.
        assert_eq!(feed(&["bc", "abc"], &["xabc"]), ("x".into(), Some(1)));
        assert_eq!(feed(&["bc", "abc"], &["xa", "bc"]), ("x".into(), Some(1)));
        // "bc" completes inside "abcd" before "abcd" does.
        assert_eq!(feed(&["abcd", "bc"], &["abcd"]), ("a".into(), Some(1)));
    }

    #[test]
    fn result_is_independent_of_chunking() {
        let stops = ["ab", "bca", "cc", "aaa"];
        let mut rng = Rng::seed_from_u64(3);
        for _ in 0..500 {
            let len = 1 + (rng.next_u64() % 12) as usize;
            let text: String = (0..len)
                .map(|_| ['a', 'b', 'c', 'é'][(rng.next_u64() % 4) as usize])
                .collect();
            let whole = feed(&stops, &[text.as_str()]);
            let chars: Vec<char> = text.chars().collect();
            let mut deltas = Vec::new();
            let mut i = 0;
            while i < chars.len() {
                let n = 1 + (rng.next_u64() % 3) as usize;
                let end = (i + n).min(chars.len());
                deltas.push(chars[i..end].iter().collect::<String>());
                i = end;
            }
            let refs: Vec<&str> = deltas.iter().map(String::as_str).collect();
            assert_eq!(
                feed(&stops, &refs),
                whole,
                "text {text:?} deltas {deltas:?}"
            );
            // Reference: the first-ending occurrence over the whole text.
            let expected = stops
                .iter()
                .enumerate()
                .filter_map(|(i, s)| text.find(s).map(|p| (p + s.len(), p, i)))
                .min();
            match expected {
                Some((_, p, i)) => assert_eq!(whole, (text[..p].to_string(), Some(i))),
                None => assert_eq!(whole, (text.clone(), None)),
            }
        }
    }
}
