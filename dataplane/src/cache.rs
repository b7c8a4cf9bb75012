//! The last good config on disk, so a proxy restarted while the control plane is down
//! still serves.

use std::io::Write;
use std::path::{Path, PathBuf};

use portcullis_config::{ConfigSet, Object, ShardSelector};
use serde::{Deserialize, Serialize};

const FILE_NAME: &str = "config-cache.json";

pub(crate) struct ConfigCache {
    path: PathBuf,
    /// The shard this proxy serves: a cache written for another (the proxy restarted with
    /// another `--shard` on the same directory) is not this proxy's config.
    shard: ShardSelector,
}

#[derive(Serialize, Deserialize)]
struct CacheFile {
    version: u64,
    /// Absent in caches written before it was recorded: read as the empty selector.
    #[serde(default)]
    shard: ShardSelector,
    objects: Vec<serde_json::Value>,
}

impl ConfigCache {
    pub(crate) fn new(dir: PathBuf, shard: ShardSelector) -> ConfigCache {
        ConfigCache {
            path: dir.join(FILE_NAME),
            shard,
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Atomic: a crash leaves either the previous file or the new one, never a torn write.
    pub(crate) async fn store(&self, version: u64, config: &ConfigSet) -> std::io::Result<()> {
        let file = CacheFile {
            version,
            shard: self.shard.clone(),
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
        if file.shard != self.shard {
            return Err(format!(
                "it holds shard {:?}, and this proxy serves shard {:?}",
                file.shard, self.shard
            ));
        }
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
    // Named per process: two proxies pointed at one directory must not write one file.
    let temporary = path.with_extension(format!("json.{}.tmp", std::process::id()));
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
        let cache = ConfigCache::new(dir.path().join("nested"), ShardSelector::new());
        assert!(cache.load().await.unwrap().is_none());
        let config = ConfigSet::from_objects(parse_documents(CONFIG).unwrap()).unwrap();
        cache.store(7, &config).await.unwrap();
        let (version, objects) = cache.load().await.unwrap().unwrap();
        assert_eq!(version, 7);
        assert_eq!(ConfigSet::from_objects(objects).unwrap(), config);
        let left: Vec<_> = std::fs::read_dir(dir.path().join("nested")).unwrap().collect();
        assert_eq!(left.len(), 1, "no temporary file left: {left:?}");
    }

    #[tokio::test]
    async fn a_cache_of_another_shard_is_not_served() {
        let dir = tempfile::tempdir().unwrap();
        let shard = |value: &str| ShardSelector::from([("zone".to_string(), value.to_string())]);
        let config = ConfigSet::from_objects(parse_documents(CONFIG).unwrap()).unwrap();
        ConfigCache::new(dir.path().to_path_buf(), shard("a"))
            .store(7, &config)
            .await
            .unwrap();
        let other = ConfigCache::new(dir.path().to_path_buf(), shard("b"));
        let error = other.load().await.unwrap_err();
        assert!(error.contains("this proxy serves shard"), "{error}");
        assert!(ConfigCache::new(dir.path().to_path_buf(), shard("a"))
            .load()
            .await
            .unwrap()
            .is_some());
    }

    #[tokio::test]
    async fn corrupt_file_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ConfigCache::new(dir.path().to_path_buf(), ShardSelector::new());
        std::fs::write(cache.path(), b"{\"version\": 3, \"objects\": [").unwrap();
        assert!(cache.load().await.is_err());
        std::fs::write(cache.path(), br#"{"version": 3, "objects": [{"kind": "Nope"}]}"#).unwrap();
        assert!(cache.load().await.is_err());
    }
}
