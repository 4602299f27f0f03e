package segment

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/aws/smithy-go/logging"
)

// OpenOptions tune a Store opened by Open. The zero value gives the
// defaults.
type OpenOptions struct {
	// RequestTimeout bounds each attempt of an S3 request, including
	// reading the response body (default 10 s). A stalled attempt ends
	// at the timeout and is retried.
	RequestTimeout time.Duration
	// MaxAttempts is how many times an S3 request is tried before its
	// error is returned (default 5; 1 disables retries).
	MaxAttempts int
	// MinBackoff and MaxBackoff bound the exponential backoff with full
	// jitter between attempts (defaults 50 ms and 5 s).
	MinBackoff, MaxBackoff time.Duration
	// MaxConns is the number of concurrent connections to keep open to
	// the S3 endpoint (default 64).
	MaxConns int
	// AccessKeyID and SecretAccessKey, when set, are used instead of the
	// standard AWS credential chain (environment, shared config files,
	// container and instance roles). Mostly for tests.
	AccessKeyID, SecretAccessKey, SessionToken string
	// Stats, when set, counts every request attempt the store makes (the
	// file backend's calls too). Nil counts nothing.
	Stats *RequestStats
	// Logger receives the AWS SDK's own messages for an s3 location, such
	// as its warning when the instance metadata service refuses IMDSv2.
	// Nil drops them; the SDK would otherwise write them to stderr as
	// plain text.
	Logger logging.Logger
}

func (o OpenOptions) withDefaults() OpenOptions {
	if o.RequestTimeout <= 0 {
		o.RequestTimeout = 10 * time.Second
	}
	if o.MaxAttempts <= 0 {
		o.MaxAttempts = 5
	}
	if o.MinBackoff <= 0 {
		o.MinBackoff = 50 * time.Millisecond
	}
	if o.MaxBackoff <= 0 {
		o.MaxBackoff = 5 * time.Second
	}
	if o.MaxBackoff < o.MinBackoff {
		o.MaxBackoff = o.MinBackoff
	}
	if o.MaxConns <= 0 {
		o.MaxConns = 64
	}
	return o
}

// Location is a parsed storage URL.
type Location struct {
	// Scheme is "s3" or "file".
	Scheme string
	// Bucket and Prefix (without surrounding slashes) for s3.
	Bucket, Prefix string
	// Region, Endpoint and PathStyle from the s3 URL's query; Region may
	// be empty (then the AWS configuration decides, else us-east-1).
	Region, Endpoint string
	PathStyle        bool
	// Dir is the absolute, cleaned directory for file.
	Dir string
}

// String returns the location in URL form, without credentials.
func (l Location) String() string {
	if l.Scheme == "file" {
		return "file://" + l.Dir
	}
	s := "s3://" + l.Bucket
	if l.Prefix != "" {
		s += "/" + l.Prefix
	}
	return s
}

// ParseLocation parses a storage URL:
//
//	s3://BUCKET[/PREFIX][?region=R][&endpoint=URL][&path_style=true]
//	file:///ABSOLUTE/DIR
//
// It does no I/O.
func ParseLocation(rawURL string) (Location, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		// A *url.Error quotes the whole URL, credentials and all.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return Location{}, fmt.Errorf("storage URL: %w", err)
	}
	if err := CheckNoFragment(rawURL, u); err != nil {
		return Location{}, err
	}
	rawURL = redactURL(u) // the URL as the errors below may show it
	switch u.Scheme {
	case "s3":
		return parseS3Location(u)
	case "file":
		if u.Host != "" && u.Host != "localhost" {
			return Location{}, fmt.Errorf("storage URL %q: file URLs take no host (file:///abs/dir)", rawURL)
		}
		if len(u.Query()) > 0 {
			return Location{}, fmt.Errorf("storage URL %q: file URLs take no parameters", rawURL)
		}
		p := u.Path
		if p == "" || !filepath.IsAbs(p) {
			return Location{}, fmt.Errorf("storage URL %q: the directory must be absolute (file:///abs/dir)", rawURL)
		}
		return Location{Scheme: "file", Dir: filepath.Clean(p)}, nil
	case "":
		return Location{}, fmt.Errorf("storage URL %q: no scheme (want s3://bucket/prefix or file:///dir)", rawURL)
	default:
		return Location{}, fmt.Errorf("storage URL %q: unsupported scheme %q (want s3 or file)", rawURL, u.Scheme)
	}
}

func parseS3Location(u *url.URL) (Location, error) {
	l := Location{Scheme: "s3", Bucket: u.Host}
	if l.Bucket == "" {
		return Location{}, fmt.Errorf("storage URL %q: no bucket", redactURL(u))
	}
	if u.User != nil {
		return Location{}, fmt.Errorf("storage URL %q: credentials do not belong in the URL; use the AWS credential chain", redactURL(u))
	}
	if !validBucketName(l.Bucket) {
		return Location{}, fmt.Errorf("storage URL: invalid bucket name %q", l.Bucket)
	}
	l.Prefix = strings.Trim(u.Path, "/")
	if strings.Contains(l.Prefix, "//") {
		return Location{}, fmt.Errorf("storage URL: prefix %q has an empty path component", l.Prefix)
	}
	for k, vs := range u.Query() {
		if len(vs) != 1 {
			return Location{}, fmt.Errorf("storage URL: parameter %q given %d times", k, len(vs))
		}
		v := vs[0]
		switch k {
		case "region":
			l.Region = v
		case "endpoint":
			e, err := url.Parse(v)
			if err != nil {
				// A host:port without a scheme (127.0.0.1:9000) lands
				// here; the value is not shown (RedactEndpoint).
				return Location{}, fmt.Errorf("storage URL: endpoint does not parse as a URL; %s", endpointWant)
			}
			if (e.Scheme != "http" && e.Scheme != "https") || e.Host == "" {
				return Location{}, fmt.Errorf("storage URL: endpoint %q: %s", RedactEndpoint(v), endpointWant)
			}
			if e.User != nil {
				// The SDK drops an endpoint's user information from its
				// requests (they are signed with the credential chain's
				// keys), so it never authenticated anything; and Caddy
				// shows a loaded config as written (admin API /config/,
				// autosave.json), where no redaction of ours reaches.
				return Location{}, fmt.Errorf("storage URL: endpoint %q: credentials do not belong in the endpoint; use the AWS credential chain (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)", RedactEndpoint(v))
			}
			l.Endpoint = strings.TrimRight(v, "/")
		case "path_style":
			b, err := strconv.ParseBool(v)
			if err != nil {
				return Location{}, fmt.Errorf("storage URL: path_style=%q: want true or false", v)
			}
			l.PathStyle = b
		default:
			return Location{}, fmt.Errorf("storage URL: unknown parameter %q (known: region, endpoint, path_style)", k)
		}
	}
	return l, nil
}

// CheckNoFragment refuses a storage URL raw, parsed as u, with a '#' in it: url.Parse takes
// it and all that follows as a fragment, which no store uses, so a prefix
// or parameter written after one would be dropped without a word. The
// error shows the URL without the fragment, which may hold the rest of a
// secret that had a '#' in it.
func CheckNoFragment(raw string, u *url.URL) error {
	if !strings.Contains(raw, "#") {
		return nil
	}
	c := *u
	c.Fragment, c.RawFragment = "", ""
	return fmt.Errorf("storage URL %q: a '#' ends the URL there, and what follows it would be ignored; "+
		"remove it, or write a '#' that belongs in the prefix as %%23", redactURL(&c))
}

// endpointWant says what an endpoint parameter must be.
const endpointWant = "it must be an http(s) URL with a host, such as http://127.0.0.1:9000 or https://s3.example.com"

// redactURL is u as errors may show it: without user information, in the
// URL or in its endpoint parameter, where an operator may have put an
// access key and secret.
func redactURL(u *url.URL) string {
	c := *u
	c.User = nil
	if q := c.Query(); q.Has("endpoint") {
		for i, v := range q["endpoint"] {
			q["endpoint"][i] = RedactEndpoint(v)
		}
		c.RawQuery = q.Encode()
	}
	return c.String()
}

// RedactEndpoint is an endpoint parameter as errors and labels may show
// it: without user information. One that does not parse is hidden whole,
// as it may be a mistyped secret, and so is one with an '@' that did not
// parse as user information: written without "//" (KEY:SECRET@host:9000,
// http:KEY:SECRET@host), its credentials are the URL's opaque part.
func RedactEndpoint(v string) string {
	e, err := url.Parse(v)
	if err != nil {
		return "(unparsable)"
	}
	if e.User == nil && strings.Contains(v, "@") {
		return "(hidden: it holds an '@' outside user information)"
	}
	e.User = nil
	return e.String()
}

// validBucketName accepts what S3-compatible stores accept in practice:
// 3 to 63 characters of lowercase letters, digits, '.', '-' and '_'.
func validBucketName(b string) bool {
	if len(b) < 3 || len(b) > 63 {
		return false
	}
	for i := 0; i < len(b); i++ {
		c := b[i]
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '.' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// Open returns the Store for a storage URL (see ParseLocation). It does no
// network I/O: S3 credentials are resolved and the bucket is reached only
// by the first request, so Caddy can validate configs offline. Nor does it
// touch the directory of a file URL; that is created by the first Put.
func Open(rawURL string, opts OpenOptions) (Store, error) {
	loc, err := ParseLocation(rawURL)
	if err != nil {
		return nil, err
	}
	switch loc.Scheme {
	case "file":
		fs, err := NewFileStore(loc.Dir)
		if err != nil {
			return nil, err
		}
		if opts.Stats == nil {
			return fs, nil
		}
		return observedFileStore{FileStore: fs, stats: opts.Stats}, nil
	default:
		return NewS3Store(context.Background(), loc, opts)
	}
}
