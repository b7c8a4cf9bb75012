//! Prompt rendering and synthetic output text.
//!
//! Prompts are tokenized with [`crate::sim::tokenizer`], a deterministic stand-in for Qwen's
//! BPE (≈ 4 bytes per token; equal text prefixes give equal token prefixes, which is all
//! prefix caching needs). Token counts therefore approximate, not reproduce, a real vLLM's.

use crate::sim::kv_cache::hash_block;

/// Output vocabulary. Every word is at most 4 bytes, i.e. exactly one stand-in token, so a
/// reply fed back in a later turn costs as many prompt tokens as it had output tokens.
const WORDS: &[&str] = &[
    "the", "a", "of", "to", "and", "in", "is", "it", "that", "for", "on", "with", "as", "this", "by", "from",
    "at", "be", "are", "was", "can", "will", "data", "node", "pod", "load", "fast", "slow", "time", "path",
    "fit", "one",
];

/// Renders chat messages as Qwen's ChatML template does, ending with the assistant turn's
/// header so that the prompt looks like what vLLM would tokenize.
pub(super) fn chat_prompt<'a>(messages: impl IntoIterator<Item = (&'a str, String)>) -> String {
    let mut prompt = String::new();
    for (role, content) in messages {
        prompt.push_str("<|im_start|>");
        prompt.push_str(role);
        prompt.push('\n');
        prompt.push_str(&content);
        prompt.push_str("<|im_end|>\n");
    }
    prompt.push_str("<|im_start|>assistant\n");
    prompt
}

/// Deterministic output text: the same prompt always gets the same reply, like greedy
/// decoding, and different prompts get different replies.
pub(super) struct Words {
    seed: u64,
}

impl Words {
    pub fn for_prompt(tokens: &[u32]) -> Self {
        Self {
            seed: hash_block(0, tokens),
        }
    }

    /// The text of output token `index`, with the separating space before all but the first.
    pub fn token(&self, index: usize) -> String {
        let word = WORDS[(hash_block(self.seed, &[index as u32]) % WORDS.len() as u64) as usize];
        if index == 0 {
            word.to_string()
        } else {
            format!(" {word}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::tokenizer::encode;

    #[test]
    fn output_is_deterministic_and_one_token_per_word() {
        let a = Words::for_prompt(&[1, 2, 3]);
        let text: String = (0..50).map(|i| a.token(i)).collect();
        let again: String = (0..50).map(|i| Words::for_prompt(&[1, 2, 3]).token(i)).collect();
        assert_eq!(text, again);
        assert_eq!(encode(&text).len(), 50);
        let other: String = (0..50).map(|i| Words::for_prompt(&[1, 2, 4]).token(i)).collect();
        assert_ne!(text, other);
    }

    #[test]
    fn chat_template_keeps_shared_prefixes() {
        let system = ("system", "You are terse.".to_string());
        let a = chat_prompt([system.clone(), ("user", "hi".to_string())]);
        let b = chat_prompt([system, ("user", "bye".to_string())]);
        assert!(a.starts_with("<|im_start|>system\nYou are terse.<|im_end|>\n"));
        assert!(a.ends_with("<|im_start|>assistant\n"));
        let (ta, tb) = (encode(&a), encode(&b));
        assert_eq!(ta[..4], tb[..4]);
    }
}
