//! C2SP tlog-tiles paths. `tlog_tiles` writes Go sumdb's (`tile/8/<L>/<N>`, entries as
//! `tile/8/data/<N>`, the height in the path); C2SP fixes the height at 8 and leaves it out:
//! `tile/<L>/<N>[.p/<W>]` and `tile/entries/<N>[.p/<W>]`, `<N>` in zero-padded 3-digit
//! elements, all but the last prefixed `x` (1234067 → `x001/x234/067`).

use tlog_tiles::Tile;

use crate::{HEIGHT, LogError};

/// A tile's C2SP path (an entry bundle's where `t` is a data tile).
pub fn tile_path(t: &Tile) -> String {
    // `Tile::path` is `tile/<H>/…`; the height is always ours.
    let go = t.path();
    let rest = go
        .strip_prefix(&format!("tile/{HEIGHT}/"))
        .unwrap_or(go.as_str());
    match rest.strip_prefix("data/") {
        Some(n) => format!("tile/entries/{n}"),
        None => format!("tile/{rest}"),
    }
}

/// The entry bundle of level-0 tile `n` of width `w` (1–256).
pub fn bundle_tile(n: u64, w: u32) -> Tile {
    Tile::new(HEIGHT, 0, n, w.clamp(1, 1 << HEIGHT), true)
}

/// Parse a C2SP tile or entry-bundle path (strictly: what [`tile_path`] writes and nothing
/// else).
pub fn parse_tile_path(path: &str) -> Result<Tile, LogError> {
    let bad = || LogError::Path(path.chars().take(80).collect());
    let rest = path.strip_prefix("tile/").ok_or_else(bad)?;
    let go = match rest.strip_prefix("entries/") {
        Some(n) => format!("tile/{HEIGHT}/data/{n}"),
        None => {
            // Levels are 0–6, all a log of at most `MAX_SIZE` leaves has ("data" only under
            // its own name).
            let level = rest.split('/').next().ok_or_else(bad)?;
            if level.is_empty()
                || level.len() > 2
                || !level.bytes().all(|b| b.is_ascii_digit())
                || level.parse::<u8>().map_or(true, |l| l > crate::MAX_LEVEL)
            {
                return Err(bad());
            }
            format!("tile/{HEIGHT}/{rest}")
        }
    };
    // A width must be 1–255 before `Tile::from_path` sees it: it panics on `.p/0` (and on a
    // level past 63, refused above).
    if let Some((_, w)) = go.rsplit_once(".p/")
        && w.parse::<u32>().map_or(true, |w| !(1..256).contains(&w))
    {
        return Err(bad());
    }
    let t = Tile::from_path(&go).map_err(|_| bad())?;
    if t.height() != HEIGHT || tile_path(&t) != path {
        return Err(bad());
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn paths_are_c2sp_and_round_trip() {
        for (t, p) in [
            (
                Tile::new(8, 0, 1_234_067, 256, false),
                "tile/0/x001/x234/067",
            ),
            (Tile::new(8, 0, 273, 112, false), "tile/0/273.p/112"),
            (Tile::new(8, 1, 1, 17, false), "tile/1/001.p/17"),
            (Tile::new(8, 2, 0, 1, false), "tile/2/000.p/1"),
            (bundle_tile(1_234_067, 256), "tile/entries/x001/x234/067"),
            (bundle_tile(5, 3), "tile/entries/005.p/3"),
        ] {
            assert_eq!(tile_path(&t), p);
            assert_eq!(tile_path(&parse_tile_path(p).unwrap()), p);
        }
        for bad in [
            "tile/8/0/001",
            "tile/data/001",
            "tile/0/1",
            "tile/0/001.p/0",
            "tile/0/001.p/256",
            "tile/0/1234/067",
            "tile/entries/",
            "checkpoint",
            "tile/0/../001",
            "tile/0/001.p/12/x",
            "tile/64/000",
            "tile/7/000",
            "tile/99/000",
            "tile/entries/000.p/0",
            "tile/0/000.p/",
        ] {
            assert!(parse_tile_path(bad).is_err(), "{bad}");
        }
    }

    /// The spec's example: a tree of 70 000 leaves is 273 full level-0 tiles, one of width
    /// 112, one full level-1 tile, one of width 17 and a level-2 tile of width 1.
    #[test]
    fn seventy_thousand_leaves_are_the_specs_tiles() {
        let tiles = Tile::new_tiles(HEIGHT, 0, 70_000);
        let paths: Vec<String> = tiles.iter().map(tile_path).collect();
        let l0: Vec<&String> = paths.iter().filter(|p| p.starts_with("tile/0/")).collect();
        assert_eq!(l0.len(), 274);
        assert!(paths.contains(&"tile/0/273.p/112".to_string()));
        assert!(paths.contains(&"tile/1/000".to_string()));
        assert!(paths.contains(&"tile/1/001.p/17".to_string()));
        assert!(paths.contains(&"tile/2/000.p/1".to_string()));
        assert_eq!(paths.len(), 274 + 2 + 1);
    }
}
