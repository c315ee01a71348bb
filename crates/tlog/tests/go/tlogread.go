// tlogread: a reader of cgx's transparency log that no one at cgx wrote the parts of — Go's
// golang.org/x/mod/sumdb/tlog and sumdb/note (Debian's golang-golang-x-mod-dev), built in
// GOPATH mode. It reads a log directory laid out as C2SP tlog-tiles serves it, checks the
// checkpoint's signature with the log's verifier key, recomputes the tree hash from the
// tiles, checks every entry of every entry bundle by its inclusion proof against the
// checkpoint, and, given an older checkpoint, the consistency proof between them.
//
// Exit status 0 and "ok: …" when all of it holds; 1 and the reason otherwise.
package main

import (
	"encoding/binary"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
)

// c2spPath is a tile's C2SP path: Go's without the height, data tiles as entry bundles.
func c2spPath(t tlog.Tile) string {
	p := strings.TrimPrefix(t.Path(), "tile/8/")
	if strings.HasPrefix(p, "data/") {
		return "tile/entries/" + strings.TrimPrefix(p, "data/")
	}
	return "tile/" + p
}

type dirTiles struct {
	dir   string
	cache map[string][]byte
}

func (d *dirTiles) Height() int { return 8 }

func (d *dirTiles) ReadTiles(tiles []tlog.Tile) ([][]byte, error) {
	out := make([][]byte, len(tiles))
	for i, t := range tiles {
		p := c2spPath(t)
		if b, ok := d.cache[p]; ok {
			out[i] = b
			continue
		}
		b, err := os.ReadFile(filepath.Join(d.dir, p))
		if err != nil {
			return nil, err
		}
		// Kept unauthenticated: every leaf is checked by a proof against the root below.
		d.cache[p] = b
		out[i] = b
	}
	return out, nil
}

func (d *dirTiles) SaveTiles(tiles []tlog.Tile, data [][]byte) {}

// openCheckpoint checks a signed checkpoint (C2SP tlog-checkpoint in a signed note) with the
// log's key, whose name must be the origin: its size and root.
func openCheckpoint(path string, v note.Verifier) (int64, tlog.Hash, error) {
	msg, err := os.ReadFile(path)
	if err != nil {
		return 0, tlog.Hash{}, err
	}
	n, err := note.Open(msg, note.VerifierList(v))
	if err != nil {
		return 0, tlog.Hash{}, fmt.Errorf("checkpoint %s: %v", path, err)
	}
	lines := strings.SplitN(n.Text, "\n", 4)
	if len(lines) < 4 {
		return 0, tlog.Hash{}, fmt.Errorf("checkpoint %s: fewer than three lines", path)
	}
	if lines[0] != v.Name() {
		return 0, tlog.Hash{}, fmt.Errorf("checkpoint %s: origin %q is not the key's %q", path, lines[0], v.Name())
	}
	size, err := strconv.ParseInt(lines[1], 10, 64)
	if err != nil || size < 0 || strconv.FormatInt(size, 10) != lines[1] {
		return 0, tlog.Hash{}, fmt.Errorf("checkpoint %s: bad size %q", path, lines[1])
	}
	root, err := tlog.ParseHash(lines[2])
	if err != nil {
		return 0, tlog.Hash{}, fmt.Errorf("checkpoint %s: bad root: %v", path, err)
	}
	return size, root, nil
}

func fail(format string, a ...interface{}) {
	fmt.Fprintf(os.Stderr, "tlogread: "+format+"\n", a...)
	os.Exit(1)
}

func main() {
	dir := flag.String("dir", "", "the log directory")
	vkey := flag.String("vkey", "", "the log's verifier key")
	old := flag.String("old", "", "an older checkpoint the log must extend")
	flag.Parse()
	v, err := note.NewVerifier(*vkey)
	if err != nil {
		fail("verifier key: %v", err)
	}
	size, root, err := openCheckpoint(filepath.Join(*dir, "checkpoint"), v)
	if err != nil {
		fail("%v", err)
	}
	if size == 0 {
		if *old != "" {
			if n, _, err := openCheckpoint(*old, v); err != nil {
				fail("%v", err)
			} else if n > 0 {
				fail("rolled back: 0 leaves after a checkpoint of %d", n)
			}
		}
		fmt.Println("ok: 0 leaves")
		return
	}
	hr := tlog.TileHashReader(tlog.Tree{N: size, Hash: root}, &dirTiles{dir: *dir, cache: map[string][]byte{}})
	th, err := tlog.TreeHash(size, hr)
	if err != nil {
		fail("tree hash: %v", err)
	}
	if th != root {
		fail("the tiles hash to %v, the checkpoint says %v", th, root)
	}
	for n := int64(0); n*256 < size; n++ {
		w := size - n*256
		if w > 256 {
			w = 256
		}
		bt := tlog.Tile{H: 8, L: -1, N: n, W: int(w)}
		data, err := os.ReadFile(filepath.Join(*dir, c2spPath(bt)))
		if err != nil {
			fail("entry bundle: %v", err)
		}
		for k := int64(0); k < w; k++ {
			if len(data) < 2 {
				fail("bundle %s: %d entries, the tile says %d", c2spPath(bt), k, w)
			}
			l := int(binary.BigEndian.Uint16(data))
			if len(data) < 2+l {
				fail("bundle %s: entry %d cut short", c2spPath(bt), k)
			}
			entry := data[2 : 2+l]
			data = data[2+l:]
			i := n*256 + k
			p, err := tlog.ProveRecord(size, i, hr)
			if err != nil {
				fail("leaf %d: no inclusion proof: %v", i, err)
			}
			if err := tlog.CheckRecord(p, size, root, i, tlog.RecordHash(entry)); err != nil {
				fail("leaf %d: not included: %v", i, err)
			}
		}
		if len(data) != 0 {
			fail("bundle %s: bytes after its %d entries", c2spPath(bt), w)
		}
	}
	if *old != "" {
		n, h, err := openCheckpoint(*old, v)
		if err != nil {
			fail("%v", err)
		}
		if n > size {
			fail("rolled back: %d leaves after a checkpoint of %d", size, n)
		}
		if n > 0 {
			p, err := tlog.ProveTree(size, n, hr)
			if err != nil {
				fail("no consistency proof from %d: %v", n, err)
			}
			if err := tlog.CheckTree(p, size, root, n, h); err != nil {
				fail("not consistent with the checkpoint of %d: %v", n, err)
			}
		}
	}
	fmt.Printf("ok: %d leaves, root %v\n", size, root)
}
