package picomq

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/segment"
)

// defaultStorageURL is where streams live when no storage is configured: a
// directory under Caddy's data directory. It is a subdirectory of "picomq"
// rather than "picomq" itself so that the node-id file beside it is never
// seen by the file backend as a stray object.
func defaultStorageURL() string {
	return (&url.URL{Scheme: "file", Path: filepath.ToSlash(filepath.Join(appDataDir(), "picomq", "data"))}).String()
}

// appDataDir is Caddy's data directory, made absolute: with neither HOME
// nor XDG_DATA_HOME set (a service run as root without User=) Caddy's is
// "./caddy", relative to the working directory, which a file URL cannot
// say (file://caddy/... names a host).
func appDataDir() string {
	dir := caddy.AppDataDir()
	if abs, err := filepath.Abs(dir); err == nil {
		return abs
	}
	return dir
}

// storageKey normalises a storage URL into the key engines are shared under,
// so that spellings of one location ("s3://b/p/" and "S3://b/p", reordered
// query parameters) share one engine. It checks only what it needs to build
// the key; segment.Open is the authority on the rest.
//
// The key keeps the query, so credentials written into the endpoint
// parameter are in it: a log line, error or metric label that names a
// storage uses storageLabel(key), never the key or the URL itself.
func storageKey(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		// A *url.Error quotes the whole URL, credentials and all.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return "", fmt.Errorf("parsing storage URL: %w", err)
	}
	if err := segment.CheckNoFragment(raw, u); err != nil {
		return "", err
	}
	raw = storageLabel(raw) // the URL as the errors below may show it
	switch strings.ToLower(u.Scheme) {
	case "file":
		if u.Host != "" && u.Host != "localhost" {
			return "", fmt.Errorf("storage URL %q: a file URL needs an absolute path (file:///dir)", raw)
		}
		if u.Path == "" || !path.IsAbs(u.Path) {
			return "", fmt.Errorf("storage URL %q: a file URL needs an absolute path (file:///dir)", raw)
		}
		// The key is a URL again (storageLabel parses it): the path goes
		// back in escaped, or a directory named with a %, ? or # would
		// make a key that parses as something else, or not at all.
		return "file://" + (&url.URL{Path: path.Clean(u.Path)}).EscapedPath(), nil
	case "s3":
		if u.Host == "" {
			return "", fmt.Errorf("storage URL %q: missing bucket (s3://BUCKET/PREFIX)", raw)
		}
		key := "s3://" + u.Host + "/" + (&url.URL{Path: strings.Trim(u.Path, "/")}).EscapedPath()
		// Spelled as the store's parser reads them, so that two spellings
		// of one storage are one key here too (and caddy validate says
		// what caddy run would): an endpoint with or without its trailing
		// slash, path_style=1 or true.
		q := u.Query()
		if v := q["endpoint"]; len(v) == 1 {
			q.Set("endpoint", strings.TrimRight(v[0], "/"))
		}
		if v := q["path_style"]; len(v) == 1 {
			if b, err := strconv.ParseBool(v[0]); err == nil {
				q.Set("path_style", strconv.FormatBool(b))
			}
		}
		if enc := q.Encode(); enc != "" { // Encode sorts by key
			key += "?" + enc
		}
		return key, nil
	default:
		return "", fmt.Errorf("storage URL %q: unsupported scheme %q (use s3:// or file://)", raw, u.Scheme)
	}
}

// checkStorageURL checks a storage URL whole, offline: what storageKey
// needs, then the rest (bucket name, parameters) as segment.Open would.
// Its errors leave out any credentials the URL carries.
func checkStorageURL(raw string) error {
	if _, err := storageKey(raw); err != nil {
		return err
	}
	_, err := segment.ParseLocation(raw)
	return err
}

// openStore opens the object store behind a storage URL, counting its
// requests in stats; the AWS SDK's own messages go to log. It does no
// network I/O; the engine's Start is the first thing to reach the store.
func openStore(rawURL string, requestTimeout time.Duration, stats *segment.RequestStats, log *zap.Logger) (segment.Store, error) {
	st, err := segment.Open(rawURL, segment.OpenOptions{
		Stats:          stats,
		RequestTimeout: requestTimeout,
		MaxAttempts:    s3Attempts,
		MinBackoff:     s3MinBackoff,
		MaxBackoff:     s3MaxBackoff,
		Logger:         sdkLogger{log: log},
	})
	if err != nil {
		return nil, fmt.Errorf("opening storage: %w", err)
	}
	return st, nil
}

// nodeIDPath is where this node's identity for the storage lease is kept.
func nodeIDPath() string { return filepath.Join(appDataDir(), "picomq", "node-id") }

// loadNodeID returns the node id stored at p, creating a random one on first
// use. The id must survive restarts: a restarted node takes its own lease
// back at once, while any other process waits for it to expire.
func loadNodeID(p string) (string, error) {
	b, err := os.ReadFile(p)
	switch {
	case err == nil:
		id := string(bytes.TrimSpace(b))
		if !validNodeID(id) {
			return "", fmt.Errorf("node id file %s is corrupt; delete it to get a new identity", p)
		}
		return id, nil
	case !errors.Is(err, fs.ErrNotExist):
		return "", fmt.Errorf("reading node id: %w", err)
	}
	var raw [16]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return "", fmt.Errorf("generating node id: %w", err)
	}
	id := hex.EncodeToString(raw[:])
	if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return "", fmt.Errorf("creating node id directory: %w", err)
	}
	// Write to a temporary file and link it into place, so a crash never
	// leaves a half-written id and two racing first starts agree on one.
	tmp, err := os.CreateTemp(filepath.Dir(p), ".node-id-*")
	if err != nil {
		return "", fmt.Errorf("writing node id: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.WriteString(id + "\n"); err != nil {
		tmp.Close()
		return "", fmt.Errorf("writing node id: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return "", fmt.Errorf("writing node id: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("writing node id: %w", err)
	}
	err = linkFile(tmp.Name(), p)
	if errors.Is(err, syscall.EPERM) || errors.Is(err, errors.ErrUnsupported) {
		// A file system without hard links (some network and FUSE
		// mounts, which Caddy's own storage works on): the file is
		// created in place instead, exclusively, so that two first
		// starts still agree on one id.
		err = createExclusive(p, id+"\n")
	}
	if errors.Is(err, fs.ErrExist) {
		// Another process won the race; use its id, once written (an
		// exclusive create is empty for a moment).
		for range 20 {
			if b, rerr := os.ReadFile(p); rerr != nil || len(b) > 0 {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		return loadNodeID(p)
	}
	if err != nil {
		return "", fmt.Errorf("installing node id: %w", err)
	}
	return id, nil
}

// linkFile is os.Link; a variable, so that tests can play a file system
// without hard links.
var linkFile = os.Link

// createExclusive writes content to a new file p, failing with
// fs.ErrExist when p exists; a write that fails removes it. Unlike a link
// into place, a crash can leave p short; loadNodeID then refuses it as
// corrupt, naming it.
func createExclusive(p, content string) error {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	_, err = f.WriteString(content)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(p)
	}
	return err
}

// validNodeID accepts what loadNodeID writes, and other short printable ids
// an operator may have put there on purpose.
func validNodeID(id string) bool {
	if id == "" || len(id) > 128 {
		return false
	}
	for _, c := range id {
		if c <= ' ' || c > '~' {
			return false
		}
	}
	return true
}
