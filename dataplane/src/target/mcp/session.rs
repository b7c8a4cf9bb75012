//! Downstream sessions without server-side state: the `Mcp-Session-Id` a client holds is
//! the list of its upstream sessions, sealed (XChaCha20-Poly1305, RFC 8439 with a 24-byte
//! random nonce) with the McpBackend's key, so any proxy replica can open it and none
//! stores it. The McpBackend's name is bound in as associated data: a session of one
//! backend opens nowhere else.

use std::sync::{Arc, LazyLock};

use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{Key, XChaCha20Poly1305, XNonce};
use portcullis_config::SecretSource;
use rand::RngCore;
use serde::{Deserialize, Serialize};

use super::reach::ClientMeta;

/// The format of a sealed id, its first byte: a later format can be told apart.
const FORMAT: u8 = 1;
const NONCE_BYTES: usize = 24;
const KEY_BYTES: usize = 32;

/// Used when an McpBackend names no keys: one per proxy process, so sessions survive
/// config changes on this replica (and no other).
static PROCESS_KEY: LazyLock<[u8; KEY_BYTES]> = LazyLock::new(|| {
    let mut key = [0; KEY_BYTES];
    rand::rng().fill_bytes(&mut key);
    key
});

/// What a downstream session id carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Session {
    /// The protocol version agreed with the client.
    #[serde(rename = "v")]
    pub(super) version: String,
    /// One entry per server that took part in `initialize`.
    #[serde(rename = "s")]
    pub(super) servers: Vec<ServerSession>,
    /// Kept only when a server speaks 2026-07-28, which wants it on every request.
    #[serde(rename = "c", default, skip_serializing_if = "Option::is_none")]
    pub(super) client: Option<ClientMeta>,
    /// When it was sealed at `initialize`, Unix seconds: the id expires `sessionTtl` later.
    #[serde(rename = "t")]
    pub(super) issued: u64,
    /// The caller `initialize` came from ([`caller_digest`]): the session answers only to
    /// requests from the same caller, so an id that leaks is no use to anyone else.
    #[serde(rename = "a", default, skip_serializing_if = "Option::is_none")]
    pub(super) caller: Option<String>,
}

/// The request headers that say who the caller is: a bearer token or one of the API-key
/// headers MCP and LLM clients send. Not cookies, which a browser changes under a session
/// (analytics, refreshed consent) without the user changing.
const CALLER_HEADERS: &[&str] = &["authorization", "x-api-key", "api-key", "x-goog-api-key"];

/// Who sends a request, as far as sessions are concerned: a digest of its credentials
/// ([`CALLER_HEADERS`]; none without any). MCP's security best practices ask to bind session
/// ids to the user; the credential is what identifies the user here. The digest is kept,
/// not the credential: the sealed id is encrypted, but a credential has no business in it.
pub(super) fn caller_digest(headers: &http::HeaderMap) -> Option<String> {
    let mut present = CALLER_HEADERS
        .iter()
        .flat_map(|name| headers.get_all(*name).iter().map(move |value| (*name, value)))
        .peekable();
    let (first, value) = present.next()?;
    if first == "authorization" && present.peek().is_none() {
        // As builds that bound sessions to `Authorization` alone digest it, so the sessions
        // they sealed keep opening. The form below always holds a NUL, which no header
        // value does, so the two never meet.
        return Some(digest(value.as_bytes()));
    }
    let mut credentials = Vec::new();
    for (name, value) in std::iter::once((first, value)).chain(present) {
        credentials.extend_from_slice(name.as_bytes());
        credentials.push(0);
        credentials.extend_from_slice(value.as_bytes());
        credentials.push(0);
    }
    Some(digest(&credentials))
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct ServerSession {
    #[serde(rename = "n")]
    pub(super) name: String,
    /// The server's `Mcp-Session-Id`; a stateless server gives none.
    #[serde(rename = "i", default, skip_serializing_if = "Option::is_none")]
    pub(super) id: Option<String>,
    /// The protocol version the server agreed to.
    #[serde(rename = "v")]
    pub(super) version: String,
    /// The server offered no `logging` at `initialize`: `logging/setLevel` is not its
    /// business. Sessions sealed by older builds say nothing, and send it as those did.
    #[serde(rename = "l", default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) takes_no_log_level: bool,
}

impl Session {
    pub(super) fn server(&self, name: &str) -> Option<&ServerSession> {
        self.servers.iter().find(|server| server.name == name)
    }

    /// What a 2026-07-28 server is told of the client on each request: what it said at
    /// `initialize` (a session sealed without it, by an older build, says nothing).
    pub(super) fn modern_client(&self) -> Arc<ClientMeta> {
        Arc::new(
            self.client
                .clone()
                .unwrap_or_else(|| ClientMeta::from_initialize(&serde_json::json!({}))),
        )
    }
}

pub(super) struct Sealer {
    /// The first seals; all open.
    ciphers: Vec<XChaCha20Poly1305>,
    /// The McpBackend's object key.
    bound_to: Arc<str>,
    ttl: std::time::Duration,
}

/// Now, in Unix seconds (0 for a clock before 1970: every session then looks fresh).
pub(super) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

impl Sealer {
    /// Reads the keys; errors name the source, never its content.
    pub(super) fn load(
        target: &Arc<str>,
        sources: &[SecretSource],
        ttl: std::time::Duration,
    ) -> Result<Sealer, String> {
        let keys: Vec<[u8; KEY_BYTES]> = if sources.is_empty() {
            vec![*PROCESS_KEY]
        } else {
            sources
                .iter()
                .enumerate()
                .map(|(index, source)| {
                    read_key(source)
                        .map_err(|problem| format!("{target}: spec.sessionKeys[{index}]: {problem}"))
                })
                .collect::<Result<_, _>>()?
        };
        Ok(Sealer {
            ciphers: keys
                .iter()
                .map(|key| XChaCha20Poly1305::new(Key::from_slice(key)))
                .collect(),
            bound_to: target.clone(),
            ttl,
        })
    }

    pub(super) fn seal(&self, session: &Session) -> String {
        // Plain structs of strings: serializing cannot fail.
        let plain = serde_json::to_vec(session).unwrap_or_default();
        self.seal_bytes(&plain, Purpose::Session)
    }

    /// `None` for anything not sealed by one of our keys for this McpBackend, or expired.
    pub(super) fn open(&self, id: &str) -> Option<Session> {
        self.open_at(id, unix_now())
    }

    fn open_at(&self, id: &str, now: u64) -> Option<Session> {
        let (plain, _) = self.open_bytes(id, Purpose::Session)?;
        let session: Session = serde_json::from_slice(&plain).ok()?;
        (now.saturating_sub(session.issued) <= self.ttl.as_secs()).then_some(session)
    }

    /// The id of a question passed on to a session-based client. Sealed, so a client cannot
    /// send the replica its answer reaches to an address of its choosing, nor keep using an
    /// old one; the random nonce makes each id unguessable.
    pub(super) fn seal_question(&self, ticket: &QuestionTicket) -> String {
        // Strings and a number: serializing cannot fail.
        self.seal_bytes(&serde_json::to_vec(ticket).unwrap_or_default(), Purpose::Question)
    }

    /// `None` for an id not sealed for this McpBackend. Also which of its keys opened it:
    /// the one to hand the answer over with.
    pub(super) fn open_question(&self, sealed: &str) -> Option<(QuestionTicket, KeyUsed)> {
        let (plain, key) = self.open_bytes(sealed, Purpose::Question)?;
        Some((serde_json::from_slice(&plain).ok()?, key))
    }

    /// What one replica hands another: only a proxy with the McpBackend's key reads it, or
    /// writes one the other takes. Sealed with the key that sealed the question, which the
    /// holder has whatever rotation happened since.
    pub(super) fn seal_handover(&self, plain: &[u8], key: KeyUsed) -> String {
        self.seal_bytes_with(plain, Purpose::Handover, key.0)
    }

    pub(super) fn open_handover(&self, sealed: &str) -> Option<Vec<u8>> {
        self.open_bytes(sealed, Purpose::Handover).map(|(plain, _)| plain)
    }

    fn seal_bytes(&self, plain: &[u8], purpose: Purpose) -> String {
        self.seal_bytes_with(plain, purpose, 0)
    }

    fn seal_bytes_with(&self, plain: &[u8], purpose: Purpose, key: usize) -> String {
        let mut nonce = [0u8; NONCE_BYTES];
        rand::rng().fill_bytes(&mut nonce);
        let aad = purpose.associated_data(&self.bound_to);
        let payload = Payload {
            msg: plain,
            aad: &aad,
        };
        let cipher = self.ciphers.get(key).unwrap_or(&self.ciphers[0]);
        let sealed = cipher
            .encrypt(XNonce::from_slice(&nonce), payload)
            .unwrap_or_default();
        let mut bytes = Vec::with_capacity(1 + NONCE_BYTES + sealed.len());
        bytes.push(FORMAT);
        bytes.extend_from_slice(&nonce);
        bytes.extend_from_slice(&sealed);
        URL_SAFE_NO_PAD.encode(bytes)
    }

    fn open_bytes(&self, sealed: &str, purpose: Purpose) -> Option<(Vec<u8>, KeyUsed)> {
        let bytes = URL_SAFE_NO_PAD.decode(sealed).ok()?;
        let (&format, rest) = bytes.split_first()?;
        if format != FORMAT || rest.len() < NONCE_BYTES {
            return None;
        }
        let (nonce, sealed) = rest.split_at(NONCE_BYTES);
        let aad = purpose.associated_data(&self.bound_to);
        self.ciphers.iter().enumerate().find_map(|(index, cipher)| {
            let payload = Payload {
                msg: sealed,
                aad: &aad,
            };
            cipher
                .decrypt(XNonce::from_slice(nonce), payload)
                .ok()
                .map(|plain| (plain, KeyUsed(index)))
        })
    }
}

/// Which of a sealer's keys opened something.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct KeyUsed(usize);

/// What a question id carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct QuestionTicket {
    /// The peer address of the proxy waiting for the answer; `None`: only that proxy can
    /// take it.
    #[serde(rename = "h", default, skip_serializing_if = "Option::is_none")]
    pub(super) holder: Option<String>,
    /// When it was asked, Unix seconds: an old id is refused before anything is sent.
    #[serde(rename = "t")]
    pub(super) asked: u64,
    /// [`digest`] of the `Mcp-Session-Id` it was asked in.
    #[serde(rename = "s")]
    pub(super) session: String,
}

/// A short digest, to bind something to a session or a credential without carrying it.
pub(super) fn digest(secret: &[u8]) -> String {
    use sha2::Digest;
    URL_SAFE_NO_PAD.encode(&sha2::Sha256::digest(secret)[..16])
}

/// What a sealed value is for, bound in as associated data with the McpBackend's name: a
/// session id never opens as a question id or a handover, nor the reverse.
#[derive(Clone, Copy)]
enum Purpose {
    Session,
    Question,
    Handover,
}

impl Purpose {
    fn associated_data(self, bound_to: &str) -> Vec<u8> {
        match self {
            // What session ids were sealed with before question ids were: they still open.
            Purpose::Session => bound_to.as_bytes().to_vec(),
            Purpose::Question => format!("{bound_to}\0question").into_bytes(),
            Purpose::Handover => format!("{bound_to}\0handover").into_bytes(),
        }
    }
}

fn read_key(source: &SecretSource) -> Result<[u8; KEY_BYTES], String> {
    let text = source.read()?;
    let text = text.trim();
    let bytes = if text.len() == 2 * KEY_BYTES && text.bytes().all(|byte| byte.is_ascii_hexdigit()) {
        (0..KEY_BYTES)
            .map(|index| u8::from_str_radix(&text[2 * index..2 * index + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .ok()
    } else {
        STANDARD
            .decode(text)
            .ok()
            .or_else(|| URL_SAFE_NO_PAD.decode(text).ok())
    };
    bytes
        .and_then(|bytes| <[u8; KEY_BYTES]>::try_from(bytes).ok())
        .ok_or_else(|| format!("the key must be {KEY_BYTES} bytes, written in hex or base64"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: std::time::Duration = std::time::Duration::from_secs(24 * 60 * 60);

    #[test]
    fn a_session_expires_its_ttl_after_initialize() {
        let sealer = Sealer::load(
            &Arc::from("McpBackend/tools"),
            &[],
            std::time::Duration::from_secs(60),
        )
        .unwrap();
        let session = session();
        let sealed = sealer.seal(&session);
        let issued = session.issued;
        assert_eq!(sealer.open_at(&sealed, issued + 60), Some(session));
        assert_eq!(sealer.open_at(&sealed, issued + 61), None);
    }

    fn session() -> Session {
        Session {
            version: "2025-11-25".into(),
            servers: vec![ServerSession {
                name: "math".into(),
                id: Some("upstream-1".into()),
                version: "2025-06-18".into(),
                takes_no_log_level: true,
            }],
            client: None,
            issued: unix_now(),
            caller: None,
        }
    }

    fn key_file(dir: &tempfile::TempDir, name: &str, content: &str) -> SecretSource {
        let path = dir.path().join(name);
        std::fs::write(&path, content).unwrap();
        SecretSource::File(path.to_string_lossy().into_owned())
    }

    #[test]
    fn a_sealed_session_opens_with_any_current_key_and_only_for_its_backend() {
        let dir = tempfile::tempdir().unwrap();
        let old = key_file(&dir, "old", &"ab".repeat(32));
        let new = key_file(&dir, "new", &STANDARD.encode([7u8; 32]));
        let target: Arc<str> = Arc::from("McpBackend/tools");
        let before = Sealer::load(&target, std::slice::from_ref(&old), DAY).unwrap();
        // One session: each call of `session()` reads the clock, and a second may pass.
        let session = session();
        let sealed = before.seal(&session);
        assert!(
            sealed.bytes().all(|byte| (0x21..=0x7e).contains(&byte)),
            "visible ASCII"
        );
        assert!(!sealed.contains("upstream-1"), "the upstream id is not readable");

        let rotating = Sealer::load(&target, &[new.clone(), old], DAY).unwrap();
        assert_eq!(rotating.open(&sealed), Some(session.clone()));
        let resealed = rotating.seal(&session);
        assert_eq!(before.open(&resealed), None, "new sessions use the new key");

        let retired = Sealer::load(&target, std::slice::from_ref(&new), DAY).unwrap();
        assert_eq!(retired.open(&sealed), None, "the retired key's sessions are gone");
        let elsewhere = Sealer::load(&Arc::from("McpBackend/other"), &[new], DAY).unwrap();
        assert_eq!(elsewhere.open(&resealed), None);
    }

    #[test]
    fn a_session_is_bound_to_every_credential_the_caller_sends() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut map = http::HeaderMap::new();
            for (name, value) in pairs {
                map.append(*name, http::HeaderValue::from_static(value));
            }
            map
        };
        assert_eq!(caller_digest(&headers(&[])), None);
        assert_eq!(caller_digest(&headers(&[("cookie", "a=1")])), None);
        // A bearer token alone digests as older builds did: their sessions keep opening.
        assert_eq!(
            caller_digest(&headers(&[("authorization", "Bearer alice")])),
            Some(digest(b"Bearer alice"))
        );
        let alice = caller_digest(&headers(&[("x-api-key", "alice")]));
        assert!(alice.is_some(), "an API key identifies the caller");
        for other in [
            headers(&[("x-api-key", "mallory")]),
            headers(&[("api-key", "alice")]),
            headers(&[("x-api-key", "alice"), ("x-api-key", "more")]),
            headers(&[("x-api-key", "alice"), ("authorization", "Bearer mallory")]),
        ] {
            assert_ne!(caller_digest(&other), alice, "{other:?}");
        }
        assert_eq!(
            caller_digest(&headers(&[("x-api-key", "alice"), ("cookie", "changed=1")])),
            alice,
            "cookies are not the caller"
        );
    }

    #[test]
    fn forged_or_damaged_ids_do_not_open() {
        let sealer = Sealer::load(&Arc::from("McpBackend/tools"), &[], DAY).unwrap();
        let sealed = sealer.seal(&session());
        let mut damaged = sealed.clone().into_bytes();
        let last = damaged.len() - 2;
        damaged[last] = if damaged[last] == b'A' { b'B' } else { b'A' };
        for forged in [
            String::from_utf8(damaged).unwrap(),
            String::new(),
            "not base64 !".into(),
            URL_SAFE_NO_PAD.encode([1u8; 10]),
            URL_SAFE_NO_PAD.encode(br#"{"v":"2025-11-25","s":[]}"#),
        ] {
            assert_eq!(sealer.open(&forged), None, "{forged}");
        }
    }

    #[test]
    fn a_question_id_names_its_holder_only_to_its_backend_and_is_no_session() {
        let target: Arc<str> = Arc::from("McpBackend/tools");
        let sealer = Sealer::load(&target, &[], DAY).unwrap();
        let ticket = QuestionTicket {
            holder: Some("10.0.0.7:7071".into()),
            asked: unix_now(),
            session: digest(b"session-a"),
        };
        let sealed = sealer.seal_question(&ticket);
        assert!(!sealed.contains("10.0.0.7"), "{sealed}");
        assert_eq!(
            sealer.open_question(&sealed).map(|(ticket, _)| ticket),
            Some(ticket.clone())
        );
        assert_ne!(sealed, sealer.seal_question(&ticket), "each id is new");
        assert_eq!(sealer.open(&sealed), None, "a question id is no session");
        assert!(sealer.open_question(&sealer.seal(&session())).is_none());
        assert_eq!(sealer.open_handover(&sealed), None, "nor a handover");
        let mut damaged = sealed.clone().into_bytes();
        let last = damaged.len() - 2;
        damaged[last] = if damaged[last] == b'A' { b'B' } else { b'A' };
        assert!(sealer
            .open_question(&String::from_utf8(damaged).unwrap())
            .is_none());
        let dir = tempfile::tempdir().unwrap();
        let key = key_file(&dir, "key", &"cd".repeat(32));
        let other = Sealer::load(&Arc::from("McpBackend/other"), &[key], DAY).unwrap();
        assert!(other.open_question(&sealed).is_none());
    }

    /// Keys rotate between a question and its answer: the replica the answer reaches has the
    /// new key first, the holder still the old one only. The handover is sealed with the key
    /// that opened the question, so the holder reads it.
    #[test]
    fn a_handover_is_sealed_with_the_key_of_its_question() {
        let dir = tempfile::tempdir().unwrap();
        let old = key_file(&dir, "old", &"ab".repeat(32));
        let new = key_file(&dir, "new", &"cd".repeat(32));
        let target: Arc<str> = Arc::from("McpBackend/tools");
        let holder = Sealer::load(&target, std::slice::from_ref(&old), DAY).unwrap();
        let rotated = Sealer::load(&target, &[new, old], DAY).unwrap();
        let ticket = QuestionTicket {
            holder: Some("10.0.0.7:7071".into()),
            asked: unix_now(),
            session: digest(b"session-a"),
        };
        let (opened, key) = rotated.open_question(&holder.seal_question(&ticket)).unwrap();
        assert_eq!(opened, ticket);
        let handed = rotated.seal_handover(b"answer", key);
        assert_eq!(holder.open_handover(&handed), Some(b"answer".to_vec()));
        assert_eq!(
            holder.open_handover(&rotated.seal_handover(b"answer", KeyUsed(0))),
            None,
            "the new key, which the holder does not have yet"
        );
    }

    #[test]
    fn key_errors_name_the_source_not_the_key() {
        let dir = tempfile::tempdir().unwrap();
        let short = key_file(&dir, "short", "c2VjcmV0");
        let error = Sealer::load(&Arc::from("McpBackend/t"), &[short], DAY)
            .err()
            .unwrap();
        assert!(
            error.contains("spec.sessionKeys[0]") && error.contains("32 bytes"),
            "{error}"
        );
        assert!(!error.contains("c2VjcmV0"));
        let missing = SecretSource::Env("PORTCULLIS_TEST_NO_SUCH_KEY".into());
        let error = Sealer::load(&Arc::from("McpBackend/t"), &[missing], DAY)
            .err()
            .unwrap();
        assert!(
            error.contains("PORTCULLIS_TEST_NO_SUCH_KEY is not set"),
            "{error}"
        );
    }
}
