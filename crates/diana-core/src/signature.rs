//! Signed remote documents (DESIGN §6): with `remote.signature` in the local document, a
//! document from the config center is adopted only if the config center sent, in the
//! response header [`SIGNATURE_HEADER`], a signature of the exact bytes of its body made with
//! that key. The checks are the `hmac` and `ed25519-dalek` crates' own (constant time for
//! HMAC); nothing here compares a MAC by hand.
//!
//! The header's value is the signature in base64 (standard alphabet, padding optional) or
//! in hex, e.g. `openssl dgst -sha256 -hmac "$KEY" -binary diana.yaml | openssl base64 -A`.

use crate::secret::Secret;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use base64::Engine as _;
use ed25519_dalek::{Signature, VerifyingKey};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;

/// The response header of a poll that carries the signature of the document (lower case).
pub const SIGNATURE_HEADER: &str = "x-diana-signature";

/// Longest header value read as a signature (an Ed25519 signature in hex is 128).
const MAX_SIGNATURE_CHARS: usize = 256;

/// Standard base64, with or without its `=` padding.
const BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new()
        .with_encode_padding(true)
        .with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// DER prefix of an Ed25519 SubjectPublicKeyInfo (`openssl pkey -pubout`): the key's 32
/// bytes follow it.
const ED25519_SPKI_PREFIX: [u8; 12] = [
    0x30, 0x2a, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x03, 0x21, 0x00,
];

/// The key a remote document must be signed with (`remote.signature`).
#[derive(Clone, PartialEq, Eq)]
pub enum SignatureKey {
    /// `{hmac_sha256: SECRET}`: a shared secret of at least 32 bytes; the signature is
    /// HMAC-SHA256 of the body keyed with the secret's bytes as written.
    HmacSha256(Secret),
    /// `{ed25519: PUBLIC_KEY}`: the config center signs with the private key.
    Ed25519(VerifyingKey),
}

/// Why a document's signature was not accepted. Never carries a key or a MAC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignatureError {
    /// No signature header.
    Missing,
    /// A header that is not a signature of this kind (not base64/hex, wrong length).
    Malformed,
    /// A well-formed signature that does not verify: the body or the key differs.
    Mismatch,
}

impl fmt::Display for SignatureError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SignatureError::Missing => "unsigned: the answer has no x-diana-signature header",
            SignatureError::Malformed => {
                "the x-diana-signature header is not a signature of the configured kind (base64 or hex)"
            }
            SignatureError::Mismatch => "the signature does not verify with the configured key",
        })
    }
}

impl std::error::Error for SignatureError {}

/// Why `remote.signature.ed25519` is not a public key (a configuration error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ed25519KeyError {
    NotBase64,
    /// Neither 32 bytes nor the 44-byte DER form: the length decoded.
    Length(usize),
    /// 32 bytes that are not a point of the curve.
    NotAPoint,
}

impl fmt::Display for Ed25519KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ed25519KeyError::NotBase64 => f.write_str("an Ed25519 public key must be base64"),
            Ed25519KeyError::Length(n) => write!(
                f,
                "an Ed25519 public key is 32 bytes (or its 44-byte DER form), this one has {n}"
            ),
            Ed25519KeyError::NotAPoint => f.write_str("not a valid Ed25519 public key"),
        }
    }
}

impl std::error::Error for Ed25519KeyError {}

impl SignatureKey {
    /// An Ed25519 public key in base64: its 32 bytes, or the DER form that `openssl pkey
    /// -pubout` prints between the PEM lines.
    pub fn ed25519(base64_key: &str) -> Result<SignatureKey, Ed25519KeyError> {
        let bytes = BASE64
            .decode(base64_key.trim())
            .map_err(|_| Ed25519KeyError::NotBase64)?;
        let raw = match bytes.len() {
            32 => bytes.as_slice(),
            44 if bytes.starts_with(&ED25519_SPKI_PREFIX) => {
                bytes.get(ED25519_SPKI_PREFIX.len()..).unwrap_or_default()
            }
            n => return Err(Ed25519KeyError::Length(n)),
        };
        let key: [u8; 32] = raw
            .try_into()
            .map_err(|_| Ed25519KeyError::Length(raw.len()))?;
        VerifyingKey::from_bytes(&key)
            .map(SignatureKey::Ed25519)
            .map_err(|_| Ed25519KeyError::NotAPoint)
    }

    /// The key's name in the document.
    pub fn kind(&self) -> &'static str {
        match self {
            SignatureKey::HmacSha256(_) => "hmac_sha256",
            SignatureKey::Ed25519(_) => "ed25519",
        }
    }

    /// What a plan may show of the key: an Ed25519 public key in base64; `<redacted>` for
    /// an HMAC secret.
    pub fn shown(&self) -> String {
        match self {
            SignatureKey::HmacSha256(_) => "<redacted>".to_string(),
            SignatureKey::Ed25519(key) => BASE64.encode(key.as_bytes()),
        }
    }

    /// Checks `signature` (the value of [`SIGNATURE_HEADER`], if any) over `body`.
    pub fn verify(&self, body: &[u8], signature: Option<&[u8]>) -> Result<(), SignatureError> {
        let signature = signature.ok_or(SignatureError::Missing)?;
        match self {
            SignatureKey::HmacSha256(secret) => {
                let mac = decode(signature, 32)?;
                let mut hmac = Hmac::<Sha256>::new_from_slice(secret.expose().as_bytes())
                    .map_err(|_| SignatureError::Mismatch)?;
                hmac.update(body);
                hmac.verify_slice(&mac)
                    .map_err(|_| SignatureError::Mismatch)
            }
            SignatureKey::Ed25519(key) => {
                let bytes: [u8; 64] = decode(signature, 64)?
                    .try_into()
                    .map_err(|_| SignatureError::Malformed)?;
                key.verify_strict(body, &Signature::from_bytes(&bytes))
                    .map_err(|_| SignatureError::Mismatch)
            }
        }
    }
}

/// A header value as `len` bytes: hex (exactly `2 × len` hex digits) or base64.
fn decode(value: &[u8], len: usize) -> Result<Vec<u8>, SignatureError> {
    let value = value.trim_ascii();
    if value.len() > MAX_SIGNATURE_CHARS {
        return Err(SignatureError::Malformed);
    }
    let bytes = if value.len() == 2 * len && value.iter().all(u8::is_ascii_hexdigit) {
        value
            .chunks_exact(2)
            .map(|pair| {
                let text = std::str::from_utf8(pair).map_err(|_| SignatureError::Malformed)?;
                u8::from_str_radix(text, 16).map_err(|_| SignatureError::Malformed)
            })
            .collect::<Result<Vec<u8>, _>>()?
    } else {
        BASE64
            .decode(value)
            .map_err(|_| SignatureError::Malformed)?
    };
    if bytes.len() == len {
        Ok(bytes)
    } else {
        Err(SignatureError::Malformed)
    }
}

impl fmt::Debug for SignatureKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SignatureKey::HmacSha256(_) => f.write_str("HmacSha256(<redacted>)"),
            SignatureKey::Ed25519(key) => {
                write!(f, "Ed25519({})", BASE64.encode(key.as_bytes()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::{Signer, SigningKey};

    const KEY: &str = "0123456789abcdef0123456789abcdef-test-key";
    const BODY: &[u8] = b"Url: /\nrules:\n  - rpu: 5\n";

    fn hmac_key() -> SignatureKey {
        SignatureKey::HmacSha256(Secret::new(KEY).unwrap())
    }

    pub(crate) fn hmac_of(key: &str, body: &[u8]) -> Vec<u8> {
        let mut mac = Hmac::<Sha256>::new_from_slice(key.as_bytes()).unwrap();
        mac.update(body);
        mac.finalize().into_bytes().to_vec()
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn hmac_signatures_verify_in_base64_and_hex_only_over_the_exact_body() {
        let key = hmac_key();
        let mac = hmac_of(KEY, BODY);
        for header in [
            BASE64.encode(&mac),
            BASE64.encode(&mac).trim_end_matches('=').to_string(),
            hex(&mac),
            hex(&mac).to_uppercase(),
            format!(" {} ", BASE64.encode(&mac)),
        ] {
            assert_eq!(
                key.verify(BODY, Some(header.as_bytes())),
                Ok(()),
                "{header}"
            );
        }
        let good = BASE64.encode(&mac);
        assert_eq!(key.verify(BODY, None), Err(SignatureError::Missing));
        // One byte of the body changed after signing.
        let mut changed = BODY.to_vec();
        changed[10] ^= 1;
        assert_eq!(
            key.verify(&changed, Some(good.as_bytes())),
            Err(SignatureError::Mismatch)
        );
        // Signed with another key.
        let other = BASE64.encode(hmac_of(&KEY.replace('0', "1"), BODY));
        assert_eq!(
            key.verify(BODY, Some(other.as_bytes())),
            Err(SignatureError::Mismatch)
        );
        for bad in [
            "",
            "not base64!",
            "AAAA",
            &hex(&mac[..31]),
            &"A".repeat(400),
        ] {
            assert_eq!(
                key.verify(BODY, Some(bad.as_bytes())),
                Err(SignatureError::Malformed),
                "{bad}"
            );
        }
    }

    #[test]
    fn ed25519_signatures_verify_with_the_raw_or_der_public_key() {
        let signing = SigningKey::from_bytes(&[7u8; 32]);
        let public = signing.verifying_key();
        let mut der = ED25519_SPKI_PREFIX.to_vec();
        der.extend_from_slice(public.as_bytes());
        let raw_key = SignatureKey::ed25519(&BASE64.encode(public.as_bytes())).unwrap();
        let der_key = SignatureKey::ed25519(&BASE64.encode(&der)).unwrap();
        assert_eq!(raw_key, der_key);
        let signature = signing.sign(BODY).to_bytes();
        for header in [BASE64.encode(signature), hex(&signature)] {
            assert_eq!(raw_key.verify(BODY, Some(header.as_bytes())), Ok(()));
        }
        let header = BASE64.encode(signature);
        assert_eq!(
            raw_key.verify(b"Url: /\nrules:\n  - rpu: 6\n", Some(header.as_bytes())),
            Err(SignatureError::Mismatch)
        );
        // An HMAC where an Ed25519 signature is expected: wrong length.
        let mac = BASE64.encode(hmac_of(KEY, BODY));
        assert_eq!(
            raw_key.verify(BODY, Some(mac.as_bytes())),
            Err(SignatureError::Malformed)
        );
        let refused = |bad: &str| SignatureKey::ed25519(bad).err();
        assert_eq!(refused(""), Some(Ed25519KeyError::Length(0)));
        assert_eq!(refused("!!"), Some(Ed25519KeyError::NotBase64));
        assert_eq!(refused("AAAA"), Some(Ed25519KeyError::Length(3)));
        assert_eq!(
            refused(&BASE64.encode([1u8; 31])),
            Some(Ed25519KeyError::Length(31))
        );
        // About half of all 32-byte strings are no point of the curve.
        let not_points = (0..=255u8)
            .filter_map(|byte| refused(&BASE64.encode([byte; 32])))
            .inspect(|error| assert_eq!(*error, Ed25519KeyError::NotAPoint))
            .count();
        assert!((1..255).contains(&not_points), "{not_points}");
    }

    /// The commands the README gives, run once with OpenSSL 3.0 over `Url: /\nrules: [{rpu:
    /// 5}]\n`: `openssl dgst -sha256 -hmac "$KEY" -binary | openssl base64 -A`; the key line
    /// of `openssl pkey -pubout`, and `openssl pkeyutl -sign -rawin | openssl base64 -A`.
    #[test]
    fn what_the_documented_openssl_commands_print_verifies() {
        let body = b"Url: /\nrules: [{rpu: 5}]\n";
        let hmac =
            SignatureKey::HmacSha256(Secret::new("0123456789abcdef0123456789abcdef").unwrap());
        let mac = "LT/2hFRhCEvjP2pwjLpecSFPM79H0GogPcifNmPh3ck=";
        assert_eq!(hmac.verify(body, Some(mac.as_bytes())), Ok(()));
        let ed25519 =
            SignatureKey::ed25519("MCowBQYDK2VwAyEAAwNIeCtkDtM8w0cqTJsk6TXzcGUgrThzKi3IHIQcMm8=")
                .unwrap();
        let signature = "QE05RdAi+f+Z57odJ6sp4NiUXrnGuU4mtWTIlFS4Tk7XAxQyK4kdb+3qlQo0tVSEwq6rNAHsDkrOABZg+pCGDg==";
        assert_eq!(ed25519.verify(body, Some(signature.as_bytes())), Ok(()));
        assert_eq!(
            ed25519.verify(b"Url: /\nrules: [{rpu: 6}]\n", Some(signature.as_bytes())),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn keys_never_show_a_secret() {
        let shown = format!("{:?} {}", hmac_key(), hmac_key().shown());
        assert!(!shown.contains("0123456789abcdef"), "{shown}");
        for error in [
            SignatureError::Missing,
            SignatureError::Malformed,
            SignatureError::Mismatch,
        ] {
            assert!(!error.to_string().contains("0123"));
        }
    }
}
