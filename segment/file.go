package segment

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"
)

// fileTmpDir is the folder, directly under the root, where a FileStore
// stages writes. Keys never start with '.', so it can never be a key's
// first component.
const fileTmpDir = ".picomq-tmp"

// etagXattr caches an object's ETag on its inode. Objects are never
// modified in place (every write is a new inode moved into place), so the
// cached value cannot go stale. Without xattr support the ETag is
// computed from the content when needed.
const etagXattr = "user.picomq.etag"

// fileLockDir is the folder, directly under the root, of the lock files
// that make a key's compare-and-swap atomic across processes. It is apart
// from fileTmpDir, whose sweep would remove a lock file another process
// still holds.
const fileLockDir = ".picomq-locks"

const fileLockStripes = 64

// FileStore is a Store on a local directory with S3's semantics: writes are
// atomic and durable (temp file, fsync, link or rename into place, fsync of
// the directory), IfNoneMatch uses link(2), which fails if the name
// exists, and IfMatch compares and swaps under a lock. A key's '/'
// separated components are folders.
//
// The lock of a key is a mutex for the goroutines of this process and
// flock(2) on a lock file for other processes: two processes share a
// directory when a restart's new process starts before the old one has
// exited, and the manifest's compare-and-swap is what fences the old one.
//
// ETags are quoted hex MD5 digests of the content, like S3's for single
// part uploads.
type FileStore struct {
	root string
	// locks[i] is stripe i's lock in this process, a channel of one slot
	// so that a wait for it ends with the caller's context: while another
	// process holds the stripe's file lock (stopped, say), the writer in
	// this process waiting for it holds this one.
	locks [fileLockStripes]chan struct{}
	// lockFiles[i] is the open lock file of stripe i, opened on first
	// use; guarded by locks[i].
	lockFiles [fileLockStripes]*os.File

	sweepMu sync.Mutex
	// nextSweep is when writeTemp next sweeps the staging folder;
	// sweepEvery spaces the sweeps (a field so that tests can shorten it).
	nextSweep  time.Time
	sweepEvery time.Duration

	// syncDir fsyncs a folder: a field so that tests can make it fail.
	syncDir func(dir string) error
	// link is os.Link: a field so that tests can play a file system
	// without hard links.
	link func(oldname, newname string) error
	// readDir reads a folder: a field so that tests can count the reads.
	readDir func(dir string) ([]fs.DirEntry, fs.FileInfo, error)

	freshMu sync.Mutex
	// fresh holds the folders this process made whose entry in their
	// parent is not known to be durable yet, each with the number of its
	// making. A Put into such a folder syncs the parent too, whoever
	// made it: its maker may not have synced yet, or may have failed to.
	fresh    map[string]uint64
	freshSeq uint64
	// unsynced holds the folders where a Put placed a name and then
	// failed to sync the folder, each with the number of that failure:
	// the name is there to see, and a crash may take it back. A read of
	// a key there, or a create-only Put that finds its key taken, syncs
	// the folder first, so that nobody acts on an object that is not
	// durable: the WAL writer settles a failed upload by reading its key
	// back, and acknowledges the batch it finds there.
	unsynced map[string]uint64

	// lists keeps the names of the folders where listings' pages ended.
	lists listCache
	// tidyAge is how long a folder a listing finds empty must have been
	// left alone for the listing to remove it (a field so that tests can
	// change it).
	tidyAge time.Duration
	// etagBufs holds the buffers that ETags missing from xattrs are
	// computed with.
	etagBufs sync.Pool
}

// NewFileStore returns a FileStore rooted at dir, which must be absolute.
// It does no I/O: the directory is created by the first Put.
func NewFileStore(dir string) (*FileStore, error) {
	if errFileStoreUnsupported != nil {
		return nil, errFileStoreUnsupported
	}
	if !filepath.IsAbs(dir) {
		return nil, fmt.Errorf("segment: file store directory %q is not absolute", dir)
	}
	s := &FileStore{
		root:       filepath.Clean(dir),
		syncDir:    syncDir,
		link:       os.Link,
		readDir:    readDir,
		fresh:      make(map[string]uint64),
		unsynced:   make(map[string]uint64),
		sweepEvery: fileSweepEvery,
		tidyAge:    fileTidyAge,
		lists:      listCache{keep: fileListKeep, settle: fileListSettle, window: fileListWindow},
	}
	for i := range s.locks {
		s.locks[i] = make(chan struct{}, 1)
	}
	return s, nil
}

// CheckLinks makes sure that the directory's file system has hard links,
// which every create-only Put relies on. FAT, exFAT and some FUSE or SMB
// mounts lack them, and then no write could ever succeed: the start fails
// with this error rather than every write with link's. Errors that keep
// the probe from being made at all (a read-only or missing directory)
// are left to the first write, which names them.
func (s *FileStore) CheckLinks() error {
	dir := filepath.Join(s.root, fileTmpDir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil
	}
	f, err := os.CreateTemp(dir, "probe-*")
	if err != nil {
		return nil
	}
	name := f.Name()
	f.Close()
	defer os.Remove(name)
	err = s.link(name, name+".link")
	if err != nil {
		return fmt.Errorf("segment: the file system of %s does not support hard links (%w), which the file store needs "+
			"for its create-only writes: use a directory on another file system (ext4, XFS, Btrfs, ZFS, APFS) or an s3:// URL",
			s.root, err)
	}
	os.Remove(name + ".link")
	return nil
}

// String returns the store's location, file:///dir.
func (s *FileStore) String() string { return "file://" + s.root }

// Dir returns the root directory.
func (s *FileStore) Dir() string { return s.root }

// Close implements io.Closer: it closes the lock files and drops the
// names kept for listings. A later write opens them again.
func (s *FileStore) Close() error {
	s.lists.clear()
	var errs []error
	for i := range s.lockFiles {
		s.locks[i] <- struct{}{}
		if f := s.lockFiles[i]; f != nil {
			errs = append(errs, f.Close())
			s.lockFiles[i] = nil
		}
		<-s.locks[i]
	}
	return errors.Join(errs...)
}

// lock serialises the writes of one key, in this process and across
// processes: the check and the swap of an IfMatch Put must not interleave
// with another write or delete of it. The stripe is a function of the key
// alone, so that every process picks the same lock file for it.
func (s *FileStore) lock(ctx context.Context, key string) (unlock func(), err error) {
	i := crc32.ChecksumIEEE([]byte(key)) % fileLockStripes
	m := s.locks[i]
	select {
	case m <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("lock stripe %d of %s: %w", i, key, ctx.Err())
	}
	f := s.lockFiles[i]
	if f == nil {
		f, err = s.openLockFile(int(i))
		if err != nil {
			<-m
			return nil, err
		}
		s.lockFiles[i] = f
	}
	if err := lockFile(ctx, f); err != nil {
		<-m
		return nil, fmt.Errorf("lock %s: %w", f.Name(), err)
	}
	return func() {
		unlockFile(f)
		<-m
	}, nil
}

// openLockFile opens stripe i's lock file, read-only: flock needs no
// write access, and a file held open for writing would keep the file
// system from being remounted read-only.
func (s *FileStore) openLockFile(i int) (*os.File, error) {
	dir := filepath.Join(s.root, fileLockDir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	return os.OpenFile(filepath.Join(dir, fmt.Sprintf("%02d", i)), os.O_RDONLY|os.O_CREATE, 0o644)
}

// checkKey enforces the key rules of the Store interface, and those a
// file system adds.
func checkKey(key string) error {
	switch {
	case key == "":
		return errors.New("segment: empty key")
	case len(key) > 1024:
		return fmt.Errorf("segment: key of %d bytes (limit 1024)", len(key))
	case key[0] == '.':
		return fmt.Errorf("segment: key %q starts with '.'", key)
	case strings.IndexByte(key, 0) >= 0:
		return fmt.Errorf("segment: key %q contains NUL", key)
	}
	for c := range strings.SplitSeq(key, "/") {
		switch {
		case c == "":
			return fmt.Errorf("segment: key %q has an empty path component", key)
		case c == "." || c == "..":
			return fmt.Errorf("segment: key %q has a %q path component", key, c)
		case len(c) > 255:
			return fmt.Errorf("segment: key %q has a path component over 255 bytes", key)
		}
	}
	return nil
}

func (s *FileStore) path(key string) string {
	return s.root + "/" + key
}

func quoteETag(sum []byte) string { return `"` + hex.EncodeToString(sum) + `"` }

func etagOf(data []byte) string {
	sum := md5.Sum(data)
	return quoteETag(sum[:])
}

// Put implements Store.
func (s *FileStore) Put(ctx context.Context, key string, data []byte, opts PutOptions) (string, error) {
	if err := checkKey(key); err != nil {
		return "", err
	}
	if opts.IfNoneMatch && opts.IfMatch != "" {
		return "", errors.New("segment: IfNoneMatch and IfMatch together")
	}
	if err := ctx.Err(); err != nil {
		return "", err
	}
	etag := etagOf(data)
	tmp, err := s.writeTemp(data, etag)
	if err != nil {
		return "", fmt.Errorf("segment: put %s: %w", key, err)
	}
	consumed := false // renamed into place: the name may be reused
	defer func() {
		if !consumed {
			os.Remove(tmp)
		}
	}()

	target := s.path(key)
	defer s.lists.changed(key)
	// Folders can be pruned by a concurrent Delete between being made and
	// being used; start over when that happens.
	for attempt := 0; ; attempt++ {
		err := s.mkdirs(filepath.Dir(target))
		if errors.Is(err, fs.ErrNotExist) && attempt < 100 {
			continue // a parent was pruned under us
		}
		if err != nil {
			return "", fmt.Errorf("segment: put %s: %w", key, err)
		}
		consumed, err = s.place(ctx, key, tmp, target, opts)
		if errors.Is(err, fs.ErrNotExist) && attempt < 100 {
			continue
		}
		if errors.Is(err, ErrPreconditionFailed) && opts.IfNoneMatch {
			// The caller may act on the object it finds there.
			if serr := s.syncIfUnsynced(filepath.Dir(target)); serr != nil {
				return "", fmt.Errorf("segment: put %s: the key is taken, and its folder could not be synced: %w", key, serr)
			}
		}
		if err != nil {
			return "", err
		}
		break
	}
	if err := s.syncPath(filepath.Dir(target)); err != nil {
		// The name is in place: readers see it, a crash may take it back.
		return "", &unknownOutcomeError{err: fmt.Errorf("segment: put %s: %w", key, err)}
	}
	return etag, nil
}

// syncPath makes the names in dir durable, with the names of any folders
// on its path that may not be durable yet. When it fails, dir is noted
// unsynced until a later sync of it succeeds.
func (s *FileStore) syncPath(dir string) error {
	fresh := s.freshOnPath(dir)
	dirs := []string{dir}
	for d := range fresh {
		dirs = append(dirs, filepath.Dir(d))
	}
	s.freshMu.Lock()
	mark := s.unsynced[dir]
	s.freshMu.Unlock()
	if err := s.syncDirs(dirs); err != nil {
		s.freshMu.Lock()
		s.freshSeq++
		s.unsynced[dir] = s.freshSeq
		s.freshMu.Unlock()
		return err
	}
	s.freshSynced(fresh)
	s.freshMu.Lock()
	// A failure noted while this sync ran may be of a name placed after
	// it began: that one stays.
	if s.unsynced[dir] == mark {
		delete(s.unsynced, dir)
	}
	s.freshMu.Unlock()
	return nil
}

// syncIfUnsynced syncs dir if a Put failed to, so that what is there to
// see in it is durable.
func (s *FileStore) syncIfUnsynced(dir string) error {
	s.freshMu.Lock()
	_, pending := s.unsynced[dir]
	s.freshMu.Unlock()
	if !pending {
		return nil
	}
	return s.syncPath(dir)
}

// freshOnPath returns the fresh folders among dir and its parents, with
// their numbers.
func (s *FileStore) freshOnPath(dir string) map[string]uint64 {
	s.freshMu.Lock()
	defer s.freshMu.Unlock()
	found := make(map[string]uint64)
	for d := dir; len(d) >= len(s.root); d = filepath.Dir(d) {
		if n, ok := s.fresh[d]; ok {
			found[d] = n
		}
		if d == s.root {
			break
		}
	}
	return found
}

// freshSynced forgets the folders whose parents were synced after they
// were made; one made again since (pruned, then made anew) stays.
func (s *FileStore) freshSynced(synced map[string]uint64) {
	s.freshMu.Lock()
	defer s.freshMu.Unlock()
	for d, n := range synced {
		if s.fresh[d] == n {
			delete(s.fresh, d)
		}
	}
}

// place moves the staged file tmp to target under the key's lock, subject
// to opts. consumed reports that tmp was renamed away. An error matching
// fs.ErrNotExist means a folder on the way was pruned: try again.
func (s *FileStore) place(ctx context.Context, key, tmp, target string, opts PutOptions) (consumed bool, err error) {
	unlock, err := s.lock(ctx, key)
	if err != nil {
		return false, fmt.Errorf("segment: put %s: %w", key, err)
	}
	defer unlock()
	switch {
	case opts.IfNoneMatch:
		// link(2) fails with EEXIST if the name exists: an atomic
		// create-only write.
		err := s.link(tmp, target)
		if errors.Is(err, fs.ErrExist) {
			if st, serr := os.Lstat(target); serr == nil && st.IsDir() {
				return false, fmt.Errorf("segment: put %s: the key is a folder of other keys", key)
			}
			return false, ErrPreconditionFailed
		}
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return false, fmt.Errorf("segment: put %s: %w", key, err)
		}
		return false, err
	case opts.IfMatch != "":
		cur, err := s.currentETag(target)
		if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
			return false, ErrPreconditionFailed
		}
		if err != nil {
			return false, fmt.Errorf("segment: put %s: %w", key, err)
		}
		if !etagEqual(cur, opts.IfMatch) {
			return false, ErrPreconditionFailed
		}
	}
	err = os.Rename(tmp, target)
	if err == nil {
		return true, nil
	}
	if errors.Is(err, fs.ErrNotExist) {
		return false, err
	}
	var le *os.LinkError
	if errors.As(err, &le) && (errors.Is(err, syscall.EISDIR) || errors.Is(err, syscall.EEXIST) || errors.Is(err, syscall.ENOTEMPTY)) {
		return false, fmt.Errorf("segment: put %s: the key is a folder of other keys", key)
	}
	return false, fmt.Errorf("segment: put %s: %w", key, err)
}

// etagEqual compares ETags, ignoring quotes and a weak marker.
func etagEqual(a, b string) bool {
	norm := func(s string) string {
		s = strings.TrimPrefix(strings.TrimSpace(s), "W/")
		return strings.Trim(s, `"`)
	}
	return norm(a) == norm(b)
}

// writeTemp writes data to a new file in the staging folder, with its ETag
// cached in an xattr, and fsyncs it.
func (s *FileStore) writeTemp(data []byte, etag string) (string, error) {
	dir := filepath.Join(s.root, fileTmpDir)
	s.maybeSweepTemp(dir)
	f, err := os.CreateTemp(dir, "put-*")
	if errors.Is(err, fs.ErrNotExist) {
		if err = os.MkdirAll(dir, 0o755); err == nil {
			f, err = os.CreateTemp(dir, "put-*")
		}
	}
	if err != nil {
		return "", err
	}
	name := f.Name()
	fail := func(err error) (string, error) {
		f.Close()
		os.Remove(name)
		return "", err
	}
	if _, err := f.Write(data); err != nil {
		return fail(err)
	}
	// Best effort: without xattrs the ETag is computed when needed.
	setETagAttr(f, etag)
	if err := f.Sync(); err != nil {
		return fail(err)
	}
	if err := f.Close(); err != nil {
		os.Remove(name)
		return "", err
	}
	return name, nil
}

// fileTidyAge is how long a folder a listing finds empty must have been
// left alone for the listing to remove it: such folders are left by a
// crash between a delete's unlink and its rmdir, or between a Put's mkdir
// and its link, and nothing else would ever remove them. The wait only
// spares an in-flight Put a start over; it is not what makes the removal
// safe (see prune).
const fileTidyAge = time.Minute

// fileSweepEvery is how often the staging folder is swept, and how old a
// staging file must be to be swept: no write takes that long.
const fileSweepEvery = time.Hour

// maybeSweepTemp sweeps the staging folder at the first write and then
// once per sweepEvery: a crash leaves its staging files behind, and one
// that happened less than sweepEvery before the restart would otherwise
// keep them (disk space, on a disk that may be full) until a later
// restart.
func (s *FileStore) maybeSweepTemp(dir string) {
	now := time.Now()
	s.sweepMu.Lock()
	due := !now.Before(s.nextSweep)
	if due {
		s.nextSweep = now.Add(s.sweepEvery)
	}
	s.sweepMu.Unlock()
	if due {
		s.sweepTemp(dir, now.Add(-fileSweepEvery))
	}
}

// sweepTemp removes the staging files modified before cutoff, left by a
// crash of this process or another. Only old ones: writes of this process
// and of another on the same directory may be in flight.
func (s *FileStore) sweepTemp(dir string, cutoff time.Time) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		if info, err := e.Info(); err == nil && info.ModTime().Before(cutoff) {
			os.Remove(filepath.Join(dir, e.Name()))
		}
	}
}

// mkdirs makes dir and its missing parents below the root (the root
// included), noting each as fresh before it exists, so that no Put can
// see it before it is noted.
func (s *FileStore) mkdirs(dir string) error {
	var missing []string
	for d := dir; ; d = filepath.Dir(d) {
		st, err := os.Stat(d)
		if err == nil {
			if !st.IsDir() {
				return fmt.Errorf("%s is an object, not a folder", strings.TrimPrefix(d, s.root+"/"))
			}
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			if errors.Is(err, syscall.ENOTDIR) {
				return fmt.Errorf("a parent of %s is an object, not a folder", strings.TrimPrefix(d, s.root+"/"))
			}
			return err
		}
		missing = append(missing, d)
		if d == s.root || len(d) <= len(s.root) {
			if err := os.MkdirAll(filepath.Dir(s.root), 0o755); err != nil {
				return err
			}
			break
		}
	}
	for i := len(missing) - 1; i >= 0; i-- {
		s.freshMu.Lock()
		s.freshSeq++
		s.fresh[missing[i]] = s.freshSeq
		s.freshMu.Unlock()
		err := os.Mkdir(missing[i], 0o755)
		if err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
	}
	return nil
}

func (s *FileStore) syncDirs(dirs []string) error {
	seen := make(map[string]bool, len(dirs))
	for _, d := range dirs {
		if seen[d] {
			continue
		}
		seen[d] = true
		if err := s.syncDir(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	return nil
}

func syncDir(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = f.Sync()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// readDir reads the folder dir, with its attributes as they were before
// the read. It fails unless dir is a folder.
func readDir(dir string) ([]fs.DirEntry, fs.FileInfo, error) {
	f, err := os.OpenFile(dir, os.O_RDONLY|oDirectory, 0)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, nil, err
	}
	des, err := f.ReadDir(-1)
	if err != nil {
		return nil, nil, err
	}
	return des, st, nil
}

// currentETag returns the ETag of the object at path.
func (s *FileStore) currentETag(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	var buf *[fileETagBuf]byte
	defer func() { s.putETagBuf(buf) }()
	return s.fileETag(f, &buf)
}

// fileETagBuf is the size of the buffers ETags are computed with.
const fileETagBuf = 32 << 10

// fileETag reads the cached ETag of an open object, or computes it. The
// computation reads the file through *buf, taken from the store's pool if
// nil: the caller returns it with putETagBuf. Without xattrs a listing
// computes the ETag of every key it returns, and a buffer per key made
// listing a big folder churn memory.
func (s *FileStore) fileETag(f *os.File, buf **[fileETagBuf]byte) (string, error) {
	var attr [64]byte
	if n, err := getETagAttr(f, attr[:]); err == nil && n > 2 {
		return string(attr[:n]), nil
	}
	st, err := f.Stat()
	if err != nil {
		return "", err
	}
	if st.IsDir() {
		return "", fs.ErrNotExist
	}
	if *buf == nil {
		*buf, _ = s.etagBufs.Get().(*[fileETagBuf]byte)
		if *buf == nil {
			*buf = new([fileETagBuf]byte)
		}
	}
	h := md5.New()
	if _, err := io.CopyBuffer(h, io.NewSectionReader(f, 0, st.Size()), (*buf)[:]); err != nil {
		return "", err
	}
	return quoteETag(h.Sum(nil)), nil
}

// putETagBuf returns a buffer fileETag took to the pool.
func (s *FileStore) putETagBuf(buf *[fileETagBuf]byte) {
	if buf != nil {
		s.etagBufs.Put(buf)
	}
}

// GetBuffer implements BufferGetter.
func (s *FileStore) GetBuffer(ctx context.Context, key string, alloc func(n int) []byte) ([]byte, error) {
	f, st, err := s.open(ctx, key)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data := alloc(int(st.Size()))
	if _, err := io.ReadFull(f, data); err != nil {
		return nil, fmt.Errorf("segment: get %s: %w", key, err)
	}
	return data, nil
}

// open opens key's file for reading.
func (s *FileStore) open(ctx context.Context, key string) (*os.File, fs.FileInfo, error) {
	if err := checkKey(key); err != nil {
		return nil, nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, nil, err
	}
	path := s.path(key)
	if err := s.syncIfUnsynced(filepath.Dir(path)); err != nil {
		return nil, nil, fmt.Errorf("segment: get %s: a write there could not be made durable: %w", key, err)
	}
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return nil, nil, ErrNotFound
	}
	if err != nil {
		return nil, nil, fmt.Errorf("segment: get %s: %w", key, err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("segment: get %s: %w", key, err)
	}
	if st.IsDir() {
		f.Close()
		return nil, nil, ErrNotFound
	}
	return f, st, nil
}

// Get implements Store.
func (s *FileStore) Get(ctx context.Context, key string, offset, length int64) ([]byte, string, error) {
	if offset < 0 {
		return nil, "", fmt.Errorf("segment: get %s: negative offset %d", key, offset)
	}
	f, st, err := s.open(ctx, key)
	if err != nil {
		return nil, "", err
	}
	defer f.Close()
	var buf *[fileETagBuf]byte
	etag, err := s.fileETag(f, &buf)
	s.putETagBuf(buf)
	if err != nil {
		return nil, "", fmt.Errorf("segment: get %s: %w", key, err)
	}
	n := max(st.Size()-offset, 0)
	if length >= 0 && length < n {
		n = length
	}
	data := make([]byte, n)
	if n > 0 {
		if _, err := f.ReadAt(data, offset); err != nil {
			return nil, "", fmt.Errorf("segment: get %s: %w", key, err)
		}
	}
	return data, etag, nil
}

// Delete implements Store. Folders left empty are removed, up to (not
// including) the root.
func (s *FileStore) Delete(ctx context.Context, keys []string) error {
	var errs []error
	dirty := make(map[string]bool)
	for _, key := range keys {
		if err := ctx.Err(); err != nil {
			errs = append(errs, err)
			break
		}
		if err := checkKey(key); err != nil {
			errs = append(errs, err)
			continue
		}
		if err := s.deleteOne(ctx, key, "", dirty); err != nil {
			errs = append(errs, fmt.Errorf("segment: delete %s: %w", key, err))
		}
	}
	if err := s.syncDirs(slices.Collect(maps.Keys(dirty))); err != nil {
		errs = append(errs, fmt.Errorf("segment: delete: %w", err))
	}
	return errors.Join(errs...)
}

// DeleteIfMatch implements Store. The key's lock, which Put's
// compare-and-swap takes as well, makes the check and the unlink one step.
func (s *FileStore) DeleteIfMatch(ctx context.Context, key, etag string) error {
	if err := checkKey(key); err != nil {
		return err
	}
	if etag == "" {
		return fmt.Errorf("segment: delete %s: empty ETag", key)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	dirty := make(map[string]bool)
	if err := s.deleteOne(ctx, key, etag, dirty); err != nil {
		if errors.Is(err, ErrPreconditionFailed) {
			return err
		}
		return fmt.Errorf("segment: delete %s: %w", key, err)
	}
	if err := s.syncDirs(slices.Collect(maps.Keys(dirty))); err != nil {
		return fmt.Errorf("segment: delete %s: %w", key, err)
	}
	return nil
}

// deleteOne removes key, only while its ETag is ifMatch when that is set,
// and prunes the folders it leaves empty, noting in dirty the folders to
// sync.
func (s *FileStore) deleteOne(ctx context.Context, key, ifMatch string, dirty map[string]bool) error {
	path := s.path(key)
	defer s.lists.changed(key)
	unlock, err := s.lock(ctx, key)
	if err != nil {
		return err
	}
	if ifMatch != "" {
		var cur string
		cur, err = s.currentETag(path)
		if err == nil && !etagEqual(cur, ifMatch) {
			unlock()
			return ErrPreconditionFailed
		}
	}
	if err == nil {
		// unlink, not os.Remove: a key never names a folder, even an
		// empty one.
		err = unlink(path)
	}
	unlock()
	dir := filepath.Dir(path)
	switch {
	case err == nil:
		dirty[dir] = true
	case errors.Is(err, fs.ErrNotExist):
		// Gone already, perhaps by a delete that crashed before it
		// pruned: prune now, or its folders would stay for good.
	case errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR):
		return nil
	default:
		return err
	}
	s.prune(dir, dirty)
	return nil
}

// prune removes the folder dir and then its parents, up to (not
// including) the root, while they are empty, noting in dirty the folders
// to sync. rmdir fails on a folder that a concurrent Put has just written
// into, which is what keeps this safe; a Put that made a folder we then
// remove, and has yet to link its object into it, starts over.
func (s *FileStore) prune(dir string, dirty map[string]bool) {
	for dir != s.root && strings.HasPrefix(dir, s.root+"/") {
		if err := rmdir(dir); err != nil {
			return
		}
		delete(dirty, dir)
		dir = filepath.Dir(dir)
		dirty[dir] = true
	}
}
