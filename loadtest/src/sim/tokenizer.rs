//! A deterministic stand-in tokenizer, **not** Qwen's BPE.
//!
//! The simulator only needs two properties of a tokenizer: roughly realistic token counts
//! (≈ 4 bytes of English per token, like BPE vocabularies) and identical text prefixes giving
//! identical token prefixes, so that prefix caching and prefix-aware routing behave as they
//! would against a real model. Words are split on whitespace, long words into 4-byte chunks,
//! and every chunk is hashed (FNV-1a) into a vocabulary of Qwen3's size.

/// Vocabulary size of the Qwen3 tokenizer, so that ids fall in the same range as real ones.
pub const VOCAB_SIZE: u32 = 151_936;

/// Bytes per token for words longer than one chunk.
const CHUNK_BYTES: usize = 4;

/// Text → token ids. Deterministic across runs and platforms.
pub fn encode(text: &str) -> Vec<u32> {
    text.split_whitespace()
        .flat_map(|word| word.as_bytes().chunks(CHUNK_BYTES))
        .map(token_id)
        .collect()
}

fn token_id(chunk: &[u8]) -> u32 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in chunk {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    (hash % u64::from(VOCAB_SIZE)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_prefixes_give_identical_token_prefixes() {
        let system = "You are a helpful assistant that answers questions about routers. ".repeat(20);
        let a = encode(&format!("{system} What is round robin?"));
        let b = encode(&format!("{system} Why does prefix affinity help?"));
        let prefix = encode(&system);
        assert!(a.starts_with(&prefix) && b.starts_with(&prefix));
        assert_ne!(a, b);
        assert_eq!(encode("same text"), encode("same text"));
    }

    #[test]
    fn counts_and_range_are_plausible() {
        assert!(encode("").is_empty());
        // "internationalization" is 20 bytes → 5 chunks.
        assert_eq!(encode("internationalization").len(), 5);
        assert!(encode("a quick brown fox jumps").iter().all(|&t| t < VOCAB_SIZE));
    }
}
