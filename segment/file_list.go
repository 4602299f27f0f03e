package segment

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	// fileListKeep is how long the names of a folder where a page of a
	// listing ended are kept for the next page, counted from their last
	// use: the engine asks for the next page at once, a Pico client
	// paging with start_after within seconds.
	fileListKeep = 10 * time.Second
	// fileListSettle: the names of a folder modified less than this
	// before it was read are not kept. A change within the same tick of
	// the file system's clock (a few milliseconds; a second on HFS+ and
	// on ext4 with small inodes) can leave the folder's modification
	// time as it was, and kept names could not be told stale.
	fileListSettle = 2 * time.Second
	// fileListSlots bounds the folders whose names are kept at once, and
	// fileListWindow the names kept of each: a folder bigger than that is
	// read once per fileListWindow names instead of once.
	fileListSlots  = 4
	fileListWindow = 1 << 15
)

// listCache keeps the sorted names of the folders where recent pages of
// listings ended, so that the next page continues from them instead of
// reading the folder again: names are unordered on disk, and reading all
// of them for every page made a full listing cost the square of the
// folder's size.
//
// Kept names are not a snapshot that pages may go stale from: each use
// first checks that the folder's modification time, which every name made
// or removed in it changes (by this process or another sharing the
// directory), is what it was before the names were read, and this
// process's own writes drop the names they touch at once. A continued
// page therefore lists what reading the folder would have listed (a key
// made since its previous page is not missed, one deleted since is not
// listed), at the cost of a stat. The residual risk is a clock stepped
// back by more than fileListSettle between the read and a later change.
//
// Memory is bounded by fileListSlots × fileListWindow names, and an idle
// store holds none: a timer drops them fileListKeep after their last use.
type listCache struct {
	mu    sync.Mutex
	snaps []*dirSnapshot
	// reading are the folder reads in flight: a write to a folder being
	// read keeps what the read saw from being kept.
	reading []*dirRead
	// timer drops expired names; nil while none are kept.
	timer *time.Timer

	// Fields so that tests can change them.
	keep, settle time.Duration
	window       int
}

// dirSnapshot is the sorted names of a part of a folder.
type dirSnapshot struct {
	dir string // relative to the root: "" or ending in '/'
	// from and fromIncl bound the part: it holds every name of the folder
	// from from on (after from unless fromIncl) up to its last entry, and
	// on to the end of the folder if complete.
	from     string
	fromIncl bool
	entries  []listEntry
	complete bool
	// st is the folder's, read before its names; keepable says that it
	// was modified long enough before that for st to tell a later change.
	st       fs.FileInfo
	keepable bool
	expires  time.Time // while kept; guarded by listCache.mu
}

// covers reports whether the snapshot holds every name of its folder from
// from on (after from unless incl) as far as it goes, and at least one
// of them unless it goes to the folder's end.
func (p *dirSnapshot) covers(from string, incl bool) bool {
	if p.from > from || p.from == from && incl && !p.fromIncl {
		return false
	}
	if p.complete {
		return true
	}
	last := p.entries[len(p.entries)-1].name
	return from < last || incl && from == last
}

type dirRead struct {
	dir     string
	spoiled bool // guarded by listCache.mu
}

// lookup returns the kept names of dir that cover from, if any.
func (c *listCache) lookup(dir, from string, incl bool, now time.Time) *dirSnapshot {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, p := range c.snaps {
		if p.dir == dir && now.Before(p.expires) && p.covers(from, incl) {
			return p
		}
	}
	return nil
}

// begin registers a read of dir; done ends it.
func (c *listCache) begin(dir string) *dirRead {
	r := &dirRead{dir: dir}
	c.mu.Lock()
	c.reading = append(c.reading, r)
	c.mu.Unlock()
	return r
}

func (c *listCache) done(r *dirRead) {
	if r == nil {
		return
	}
	c.mu.Lock()
	c.reading = slices.DeleteFunc(c.reading, func(x *dirRead) bool { return x == r })
	c.mu.Unlock()
}

// changed drops what is kept of the folders on key's path, and spoils
// their reads in flight: key was just written or deleted, and folders on
// its path may have been made or pruned.
func (c *listCache) changed(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.snaps = slices.DeleteFunc(c.snaps, func(p *dirSnapshot) bool { return strings.HasPrefix(key, p.dir) })
	for _, r := range c.reading {
		if strings.HasPrefix(key, r.dir) {
			r.spoiled = true
		}
	}
}

// drop forgets p.
func (c *listCache) drop(p *dirSnapshot) {
	c.mu.Lock()
	c.snaps = slices.DeleteFunc(c.snaps, func(x *dirSnapshot) bool { return x == p })
	c.mu.Unlock()
}

// hold keeps p, read by r (nil if p came from the cache), for the next
// page, or extends its keeping.
func (c *listCache) hold(p *dirSnapshot, r *dirRead, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !slices.Contains(c.snaps, p) {
		if r == nil || r.spoiled || !p.keepable {
			return // dropped since it was looked up, or stale, or may be
		}
		c.snaps = slices.DeleteFunc(c.snaps, func(x *dirSnapshot) bool { return x.dir == p.dir })
		if len(c.snaps) >= fileListSlots {
			// Make room by dropping the one whose use is oldest.
			i := 0
			for j, x := range c.snaps {
				if x.expires.Before(c.snaps[i].expires) {
					i = j
				}
			}
			c.snaps = slices.Delete(c.snaps, i, i+1)
		}
		c.snaps = append(c.snaps, p)
	}
	p.expires = now.Add(c.keep)
	if c.timer == nil {
		c.timer = time.AfterFunc(c.keep, func() { c.expire(time.Now()) })
	}
}

// expire drops the names kept past their time, and stops the timer when
// none are left.
func (c *listCache) expire(now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.snaps = slices.DeleteFunc(c.snaps, func(p *dirSnapshot) bool { return !now.Before(p.expires) })
	if len(c.snaps) == 0 {
		if c.timer != nil {
			c.timer.Stop()
			c.timer = nil
		}
		return
	}
	next := c.snaps[0].expires
	for _, p := range c.snaps {
		if p.expires.Before(next) {
			next = p.expires
		}
	}
	if c.timer != nil {
		c.timer.Reset(next.Sub(now))
	}
}

// clear drops everything.
func (c *listCache) clear() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.snaps = nil
	if c.timer != nil {
		c.timer.Stop()
		c.timer = nil
	}
}

// dirNames returns the sorted names of the folder dir from from on (after
// from unless incl): kept ones if they are still current, else read
// afresh, with the read to pass to hold and done.
func (s *FileStore) dirNames(dir, from string, incl bool) (*dirSnapshot, *dirRead, error) {
	path := filepath.Join(s.root, dir)
	now := time.Now()
	if p := s.lists.lookup(dir, from, incl, now); p != nil {
		st, err := os.Stat(path)
		if err == nil && os.SameFile(st, p.st) && st.ModTime().Equal(p.st.ModTime()) {
			return p, nil, nil
		}
		s.lists.drop(p)
	}
	r := s.lists.begin(dir)
	des, st, err := s.readDir(path)
	if err != nil {
		s.lists.done(r)
		return nil, nil, err
	}
	entries := make(entryHeap, 0, len(des))
	for _, de := range des {
		name := de.Name()
		if dir == "" && name[0] == '.' {
			continue // the staging folder, or anything else not a key
		}
		switch {
		case de.IsDir():
			// Byte order of full keys: a folder sorts as its name
			// plus '/', and keys under it all start with that.
			name += "/"
		case !de.Type().IsRegular():
			continue
		}
		if name > from || incl && name == from {
			entries = append(entries, listEntry{name: name, isDir: de.IsDir()})
		}
	}
	if len(des) == 0 && dir != "" && st.ModTime().Before(now.Add(-s.tidyAge)) {
		// Empty for a while: left by a crash (see fileTidyAge).
		s.prune(path, make(map[string]bool))
		s.lists.changed(dir)
		s.lists.done(r)
		return &dirSnapshot{dir: dir, from: from, fromIncl: incl, complete: true}, nil, nil
	}
	p := &dirSnapshot{
		dir:      dir,
		from:     from,
		fromIncl: incl,
		st:       st,
		keepable: st.ModTime().Before(now.Add(-s.lists.settle)),
	}
	if len(entries) <= s.lists.window {
		slices.SortFunc(entries, func(a, b listEntry) int { return strings.Compare(a.name, b.name) })
		p.entries, p.complete = entries, true
	} else {
		// The first window of names only: a heap takes them in order
		// without sorting the rest.
		heap.Init(&entries)
		p.entries = make([]listEntry, s.lists.window)
		for i := range p.entries {
			p.entries[i] = heap.Pop(&entries).(listEntry)
		}
	}
	return p, r, nil
}

// List implements Store. max <= 0 means 1,000. Only the folders that can
// hold keys in range are read: the walk starts at the deepest folder the
// prefix names, and skips folders wholly before startAfter.
func (s *FileStore) List(ctx context.Context, prefix, startAfter string, max int) ([]ObjectInfo, bool, error) {
	if max <= 0 {
		max = 1000
	}
	w := &fileLister{
		s:          s,
		ctx:        ctx,
		prefix:     prefix,
		startAfter: startAfter,
		max:        max,
	}
	base := ""
	if i := strings.LastIndexByte(prefix, '/'); i >= 0 {
		base = prefix[:i+1]
	}
	err := w.walk(base)
	s.putETagBuf(w.etagBuf)
	if errors.Is(err, errListFull) {
		err = nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("segment: list %s: %w", prefix, err)
	}
	return w.objs, w.more, nil
}

var errListFull = errors.New("listing full")

type fileLister struct {
	s                  *FileStore
	ctx                context.Context
	prefix, startAfter string
	max                int
	objs               []ObjectInfo
	more               bool
	// etagBuf computes the ETags missing from xattrs, one for the
	// listing.
	etagBuf *[fileETagBuf]byte
}

type listEntry struct {
	name  string // as sorted: folders end in '/'
	isDir bool
}

// entryHeap is a min-heap of a folder's entries by name.
type entryHeap []listEntry

func (h entryHeap) Len() int           { return len(h) }
func (h entryHeap) Less(i, j int) bool { return h[i].name < h[j].name }
func (h entryHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *entryHeap) Push(x any)        { *h = append(*h, x.(listEntry)) }
func (h *entryHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

// walk visits the folder dir ("" for the root, else ending in '/') in key
// order, from the first of its names that can hold keys in range.
func (w *fileLister) walk(dir string) error {
	var from string
	switch {
	case strings.HasPrefix(w.startAfter, dir):
		// The name startAfter is under, or startAfter's own.
		from = w.startAfter[len(dir):]
		if i := strings.IndexByte(from, '/'); i >= 0 {
			from = from[:i+1]
		}
	case w.startAfter > dir:
		return nil // every key in dir is before startAfter
	}
	// Names in range start with what of the prefix is left below dir.
	pre := ""
	if strings.HasPrefix(w.prefix, dir) {
		pre = w.prefix[len(dir):]
	}
	from = max(from, pre)
	incl := true
	for {
		if err := w.ctx.Err(); err != nil {
			return err
		}
		p, r, err := w.s.dirNames(dir, from, incl)
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
			return nil // folder pruned meanwhile, never made, or an object
		}
		if err != nil {
			return err
		}
		end, err := w.visit(dir, p, from, incl, pre)
		if errors.Is(err, errListFull) {
			w.s.lists.hold(p, r, time.Now())
		}
		w.s.lists.done(r)
		if err != nil || end || p.complete {
			return err
		}
		from, incl = p.entries[len(p.entries)-1].name, false
	}
}

// visit lists the entries of p from from on, in the folder dir. end
// reports that the names past the prefix were reached.
func (w *fileLister) visit(dir string, p *dirSnapshot, from string, incl bool, pre string) (end bool, err error) {
	i := sort.Search(len(p.entries), func(i int) bool {
		n := p.entries[i].name
		return n > from || incl && n == from
	})
	for _, e := range p.entries[i:] {
		if !strings.HasPrefix(e.name, pre) {
			return true, nil // sorted: none after it has the prefix either
		}
		full := dir + e.name
		if e.isDir {
			if full <= w.startAfter && !strings.HasPrefix(w.startAfter, full) {
				continue // every key in it is before startAfter
			}
			if err := w.walk(full); err != nil {
				return false, err
			}
			continue
		}
		if full <= w.startAfter {
			continue
		}
		if len(w.objs) == w.max {
			w.more = true
			return false, errListFull
		}
		info, err := w.info(full)
		if errors.Is(err, fs.ErrNotExist) {
			continue // deleted meanwhile
		}
		if err != nil {
			return false, err
		}
		w.objs = append(w.objs, info)
	}
	return false, nil
}

func (w *fileLister) info(key string) (ObjectInfo, error) {
	f, err := os.Open(w.s.path(key))
	if err != nil {
		return ObjectInfo{}, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return ObjectInfo{}, err
	}
	etag, err := w.s.fileETag(f, &w.etagBuf)
	if err != nil {
		return ObjectInfo{}, err
	}
	return ObjectInfo{Key: key, Size: st.Size(), ETag: etag}, nil
}
