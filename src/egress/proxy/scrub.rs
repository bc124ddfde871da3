//! Masking the operator's header values in what upstreams send back, in the forms an echo
//! may show them, across read boundaries, and at the end of an answer cut short.

/// A header value as an echo may show it: as sent, JSON-escaped (`/` as `\/`), percent-
/// encoded, and in base64. Masking is best effort beyond these (docs/design.md D13): an
/// upstream that echoes requests back otherwise transformed is not a host to add secrets for.
pub(super) fn secret_forms(value: &str) -> Vec<Vec<u8>> {
    use base64::Engine as _;
    let mut forms = vec![value.as_bytes().to_vec()];
    forms.push(value.replace('/', "\\/").into_bytes());
    let pct: String = value
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect();
    forms.push(pct.into_bytes());
    forms.push(base64::engine::general_purpose::STANDARD.encode(value).into_bytes());
    forms.sort();
    forms.dedup();
    forms
}

/// Masks every secret in a stream with '*' of the same length (lengths, and so
/// Content-Length, stay right), holding back just enough to catch one cut between chunks.
#[derive(Debug, Default)]
pub(super) struct Scrubber {
    secrets: Vec<Vec<u8>>,
    pending: Vec<u8>,
}

impl Scrubber {
    pub(super) fn new(secrets: Vec<Vec<u8>>) -> Self {
        Self { secrets, pending: Vec::new() }
    }

    fn hold(&self) -> usize {
        self.secrets.iter().map(Vec::len).max().unwrap_or(1).saturating_sub(1)
    }

    /// Bytes safe to send after `chunk`.
    pub(super) fn push(&mut self, chunk: &[u8]) -> Vec<u8> {
        if self.secrets.is_empty() {
            return chunk.to_vec();
        }
        self.pending.extend_from_slice(chunk);
        for s in &self.secrets {
            let mut i = 0;
            while let Some(at) = self.pending[i..].windows(s.len()).position(|w| w == s.as_slice()) {
                let start = i + at;
                self.pending[start..start + s.len()].fill(b'*');
                i = start + s.len();
            }
        }
        let keep = self.hold().min(self.pending.len());
        let send = self.pending.len() - keep;
        self.pending.drain(..send).collect()
    }

    /// What is held back, at the end of the stream (the upstream's answer ended, or the
    /// run's budget cut it): the held bytes may be the start of a secret whose rest never
    /// came, so from the first held byte that starts some masked form, the rest is masked.
    pub(super) fn finish(&mut self) -> Vec<u8> {
        let mut out = std::mem::take(&mut self.pending);
        let start = (0..out.len()).find(|&i| self.secrets.iter().any(|s| s.starts_with(&out[i..])));
        if let Some(i) = start {
            out[i..].fill(b'*');
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echoed_secrets_are_masked_in_their_common_encodings() {
        let secret = "tok/en+1 2";
        let mut scrub = Scrubber::new(secret_forms(secret));
        let echo = format!("raw {secret} json {} pct {} b64 {}", secret.replace('/', "\\/"), "tok%2Fen%2B1%202", {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD.encode(secret)
        });
        let mut out = scrub.push(echo.as_bytes());
        out.extend(scrub.finish());
        let out = String::from_utf8(out).expect("text");
        assert_eq!(out.len(), echo.len(), "lengths kept");
        for form in secret_forms(secret) {
            let form = String::from_utf8(form).expect("text");
            assert!(!out.contains(&form), "{form} left in {out}");
        }
    }

    #[test]
    fn secrets_are_masked_across_chunk_boundaries() {
        let mut s = Scrubber::new(vec![b"s3cret-token".to_vec()]);
        let input = b"a s3cret-token b s3cr".to_vec();
        let mut out = s.push(&input);
        out.extend(s.push(b"et-token c"));
        out.extend(s.finish());
        assert_eq!(String::from_utf8(out).expect("utf-8"), "a ************ b ************ c");
        let mut none = Scrubber::new(Vec::new());
        assert_eq!(none.push(b"plain"), b"plain");
    }
}
