//! The last good config on disk, so a proxy restarted while the control plane is down
//! still serves.

use std::io::Write;
use std::path::{Path, PathBuf};

use portcullis_config::{ConfigSet, Object};
use serde::{Deserialize, Serialize};

const FILE_NAME: &str = "config-cache.json";

pub(crate) struct ConfigCache {
    path: PathBuf,
}

#[derive(Serialize, Deserialize)]
struct CacheFile {
    version: u64,
    objects: Vec<serde_json::Value>,
}

impl ConfigCache {
    pub(crate) fn new(dir: PathBuf) -> ConfigCache {
        ConfigCache {
            path: dir.join(FILE_NAME),
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Atomic: a crash leaves either the previous file or the new one, never a torn write.
    pub(crate) async fn store(&self, version: u64, config: &ConfigSet) -> std::io::Result<()> {
        let file = CacheFile {
            version,
            objects: config.objects().map(Object::to_json).collect(),
        };
        let bytes = serde_json::to_vec_pretty(&file)?;
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || write_atomically(&path, &bytes)).await?
    }

    /// `Ok(None)` when there is no cache yet; an error for a file that cannot be used.
    pub(crate) async fn load(&self) -> Result<Option<(u64, Vec<Object>)>, String> {
        let bytes = match tokio::fs::read(&self.path).await {
            Ok(bytes) => bytes,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(error.to_string()),
        };
        let file: CacheFile = serde_json::from_slice(&bytes).map_err(|error| error.to_string())?;
        let objects = file
            .objects
            .into_iter()
            .enumerate()
            .map(|(index, value)| Object::from_json(value, &format!("cached object {}", index + 1)))
            .collect::<Result<_, _>>()
            .map_err(|error| error.to_string())?;
        Ok(Some((file.version, objects)))
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let temporary = path.with_extension("json.tmp");
    let mut file = std::fs::File::create(&temporary)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    std::fs::rename(&temporary, path)?;
    // The rename itself is only durable once the directory entry is.
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use portcullis_config::parse_documents;

    const CONFIG: &str = "apiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {name: api}\nspec: {endpoints: ['127.0.0.1:9000'], http2: true}\n";

    #[tokio::test]
    async fn round_trips_version_and_objects() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ConfigCache::new(dir.path().join("nested"));
        assert!(cache.load().await.unwrap().is_none());
        let config = ConfigSet::from_objects(parse_documents(CONFIG).unwrap()).unwrap();
        cache.store(7, &config).await.unwrap();
        let (version, objects) = cache.load().await.unwrap().unwrap();
        assert_eq!(version, 7);
        assert_eq!(ConfigSet::from_objects(objects).unwrap(), config);
        assert!(!cache.path().with_extension("json.tmp").exists());
    }

    #[tokio::test]
    async fn corrupt_file_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ConfigCache::new(dir.path().to_path_buf());
        std::fs::write(cache.path(), b"{\"version\": 3, \"objects\": [").unwrap();
        assert!(cache.load().await.is_err());
        std::fs::write(cache.path(), br#"{"version": 3, "objects": [{"kind": "Nope"}]}"#).unwrap();
        assert!(cache.load().await.is_err());
    }
}
