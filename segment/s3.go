package segment

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/credentials/ec2rolecreds"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	s3types "github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/aws/smithy-go"
	"github.com/aws/smithy-go/logging"
	smithyhttp "github.com/aws/smithy-go/transport/http"
)

// ErrUnknownOutcome is matched (errors.Is) by the error of a Put that may or
// may not have been applied: an attempt timed out, lost its connection or
// its answer, or got a 5xx that a store may send after writing, and no
// later attempt settled it (a conditional retry that found the condition
// false without the object holding the data that was written, or one that
// failed too); or a file whose name is in place but could not be made
// durable. Callers must treat the write as possibly applied.
var ErrUnknownOutcome = errors.New("outcome of the write is unknown")

// unknownOutcomeError is a Put's failure, with its text as it is, that
// matches ErrUnknownOutcome: its outcome is unknown.
type unknownOutcomeError struct{ err error }

func (e *unknownOutcomeError) Error() string   { return e.err.Error() }
func (e *unknownOutcomeError) Unwrap() []error { return []error{e.err, ErrUnknownOutcome} }

// deleteBatch is the most keys one DeleteObjects request may carry.
const deleteBatch = 1000

// S3Store is a Store on an S3-compatible bucket. Keys are stored under the
// location's prefix; callers see keys relative to it.
type S3Store struct {
	client    *s3.Client
	http      *http.Client
	bucket    string
	prefix    string // "" or "p/" with a trailing slash
	loc       Location
	opts      OpenOptions
	transport *http.Transport
}

// NewS3Store builds the S3 client for loc. It reads the AWS configuration
// (environment and shared files) but does no network I/O.
func NewS3Store(ctx context.Context, loc Location, opts OpenOptions) (*S3Store, error) {
	if loc.Scheme != "s3" || loc.Bucket == "" {
		return nil, fmt.Errorf("segment: not an s3 location: %v", loc)
	}
	opts = opts.withDefaults()

	// Start from the SDK's buildable client so that settings such as
	// AWS_CA_BUNDLE are applied to the transport by LoadDefaultConfig.
	base := awshttp.NewBuildableClient().WithTransportOptions(func(tr *http.Transport) {
		// Room for every concurrent request to keep its connection, so
		// bursts of uploads and range reads do not churn through new
		// TCP and TLS handshakes.
		tr.MaxIdleConns = opts.MaxConns * 2
		tr.MaxIdleConnsPerHost = opts.MaxConns
		tr.IdleConnTimeout = 90 * time.Second
	}).WithDialerOptions(func(d *net.Dialer) {
		d.Timeout = 5 * time.Second
	})

	var cfgOpts []func(*config.LoadOptions) error
	if loc.Region != "" {
		cfgOpts = append(cfgOpts, config.WithRegion(loc.Region))
	}
	if opts.AccessKeyID != "" {
		cfgOpts = append(cfgOpts, config.WithCredentialsProvider(
			credentials.NewStaticCredentialsProvider(opts.AccessKeyID, opts.SecretAccessKey, opts.SessionToken)))
	}
	// Every client the configuration builds (the S3 client, and the
	// credential chain's metadata and STS clients) takes its logger from
	// here; without one the SDK writes to stderr.
	var sdkLog logging.Logger = logging.Nop{}
	if opts.Logger != nil {
		sdkLog = opts.Logger
	}
	cfgOpts = append(cfgOpts, config.WithHTTPClient(base), config.WithLogger(sdkLog))
	cfg, err := config.LoadDefaultConfig(ctx, cfgOpts...)
	if err != nil {
		return nil, fmt.Errorf("segment: AWS configuration: %w", err)
	}
	// No request or response logging: it would show bodies and signed
	// headers.
	cfg.ClientLogMode = 0
	if cfg.Region == "" {
		cfg.Region = "us-east-1"
	}
	// With nothing in the environment or the shared config files, the
	// chain ends at the EC2 instance role. Off EC2, or on an instance
	// without a role, the SDK's error speaks of the metadata service
	// only; say what is missing instead, the SDK's error wrapped.
	if opts.AccessKeyID == "" && aws.IsCredentialsProvider(cfg.Credentials, (*ec2rolecreds.Provider)(nil)) {
		cfg.Credentials = instanceRoleCredentials{CredentialsProvider: cfg.Credentials, hint: halfKeyPair(os.Getenv)}
	}
	// Our own client on that transport, so Close can release its idle
	// connections. Redirects are not followed: S3 redirects (wrong region)
	// are errors to report, not to chase.
	var transport *http.Transport
	if bc, ok := cfg.HTTPClient.(*awshttp.BuildableClient); ok {
		transport = bc.GetTransport()
	} else {
		transport = base.GetTransport()
	}
	httpClient := &http.Client{
		Transport: transport,
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		},
	}
	cfg.HTTPClient = httpClient

	client := s3.NewFromConfig(cfg, func(o *s3.Options) {
		if loc.Endpoint != "" {
			o.BaseEndpoint = aws.String(loc.Endpoint)
		}
		o.UsePathStyle = loc.PathStyle
		// Retries, backoff and per-attempt timeouts are done by S3Store
		// itself (see do), so that a stalled attempt is cut off and
		// retried, and so that a conditional write whose first attempt
		// had an unknown outcome is resolved rather than misreported.
		o.Retryer = aws.NopRetryer{}
		// Since SDK v1.73 the default (WhenSupported) adds a CRC32 to
		// every upload: as an x-amz-checksum-crc32 header when the body
		// can be hashed up front over plain HTTP, and over HTTPS as an
		// aws-chunked body with a trailing checksum. versitygw v1.8.0
		// accepts and stores both forms (its auth middleware decodes
		// STREAMING-UNSIGNED-PAYLOAD-TRAILER; the header form is what
		// our tests exercise), so versitygw itself does not need this.
		// Many other S3-compatible stores and proxies still reject
		// aws-chunked trailers or x-amz-checksum-* headers, though, and
		// PicoMQ's WAL and data objects carry their own checksums. So
		// send checksums only where the API requires one
		// (DeleteObjects), and validate response checksums only where
		// required too: a ranged GET has no full-object checksum to
		// check anyway.
		o.RequestChecksumCalculation = aws.RequestChecksumCalculationWhenRequired
		o.ResponseChecksumValidation = aws.ResponseChecksumValidationWhenRequired
	})

	prefix := ""
	if loc.Prefix != "" {
		prefix = loc.Prefix + "/"
	}
	return &S3Store{
		client:    client,
		http:      httpClient,
		bucket:    loc.Bucket,
		prefix:    prefix,
		loc:       loc,
		opts:      opts,
		transport: transport,
	}, nil
}

// NoCredentialsError is the error of an S3 request for which the AWS
// credential chain found no credentials: none in the environment or the
// shared config files, and none from an EC2 instance role. Err is the
// SDK's error from the instance metadata service. No retry fixes it: the
// chain is read once, when the store is opened.
type NoCredentialsError struct {
	Err error
	// Hint names half an access key pair found alone in the
	// environment, which the SDK ignores without a word (see
	// halfKeyPair); "" when there is none.
	Hint string
}

func (e *NoCredentialsError) Error() string {
	msg := "no AWS credentials: "
	if e.Hint != "" {
		msg += e.Hint + "; "
	}
	return msg + "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE and a shared " +
		"config file) in Caddy's environment, or run on an EC2 instance with a role; the instance role, " +
		"the last place the AWS credential chain looks, gave none: " + e.Err.Error()
}

// halfKeyPair says which half of an access key pair the environment holds
// without the other, or "" if none does. The SDK takes keys from the
// environment only in pairs and otherwise goes on down the chain, so a
// misspelt or unexported AWS_SECRET_ACCESS_KEY ended in an error about the
// instance role alone.
func halfKeyPair(getenv func(string) string) string {
	set := func(names ...string) string {
		for _, n := range names {
			if getenv(n) != "" {
				return n
			}
		}
		return ""
	}
	// The names the SDK reads, in its order.
	key := set("AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY")
	secret := set("AWS_SECRET_ACCESS_KEY", "AWS_SECRET_KEY")
	switch {
	case key != "" && secret == "":
		return key + " is set but AWS_SECRET_ACCESS_KEY is not, and a key without its secret is ignored"
	case secret != "" && key == "":
		return secret + " is set but AWS_ACCESS_KEY_ID is not, and a secret without its key is ignored"
	}
	return ""
}

func (e *NoCredentialsError) Unwrap() error { return e.Err }

// instanceRoleCredentials is the credential chain when all it has left is
// the EC2 instance role (the SDK's credentials cache around it). A role
// that answers is used as ever; a failure is a NoCredentialsError.
type instanceRoleCredentials struct {
	aws.CredentialsProvider
	hint string // NoCredentialsError.Hint
}

// Retrieve implements aws.CredentialsProvider.
func (p instanceRoleCredentials) Retrieve(ctx context.Context) (aws.Credentials, error) {
	c, err := p.CredentialsProvider.Retrieve(ctx)
	if err != nil && !errors.Is(err, context.Canceled) {
		return c, &NoCredentialsError{Err: err, Hint: p.hint}
	}
	return c, err
}

// IsCredentialsProvider lets aws.IsCredentialsProvider see through the
// wrapper, as it sees through the SDK's cache.
func (p instanceRoleCredentials) IsCredentialsProvider(target aws.CredentialsProvider) bool {
	return aws.IsCredentialsProvider(p.CredentialsProvider, target)
}

// ProviderSources keeps the SDK's account of where the credentials came
// from (it goes into the User-Agent).
func (p instanceRoleCredentials) ProviderSources() []aws.CredentialSource {
	if s, ok := p.CredentialsProvider.(aws.CredentialProviderSource); ok {
		return s.ProviderSources()
	}
	return nil
}

// String returns the store's location, e.g. s3://bucket/prefix.
func (s *S3Store) String() string { return s.loc.String() }

// Close releases idle connections.
func (s *S3Store) Close() error {
	s.transport.CloseIdleConnections()
	return nil
}

func (s *S3Store) full(key string) string { return s.prefix + key }

// Put implements Store.
func (s *S3Store) Put(ctx context.Context, key string, data []byte, opts PutOptions) (string, error) {
	if key == "" {
		return "", errors.New("segment: empty key")
	}
	if opts.IfNoneMatch && opts.IfMatch != "" {
		return "", errors.New("segment: IfNoneMatch and IfMatch together")
	}
	conditional := opts.IfNoneMatch || opts.IfMatch != ""
	in := &s3.PutObjectInput{
		Bucket:        aws.String(s.bucket),
		Key:           aws.String(s.full(key)),
		ContentLength: aws.Int64(int64(len(data))),
		ContentType:   aws.String("application/octet-stream"),
	}
	if opts.IfNoneMatch {
		in.IfNoneMatch = aws.String("*")
	}
	if opts.IfMatch != "" {
		in.IfMatch = aws.String(opts.IfMatch)
	}
	var etag string
	attempts := 0
	ambiguous := false   // an earlier attempt may have been applied
	folderRetry := false // the one retry of a folder race is spent
	err := s.do(ctx, OpPut, key, func(ctx context.Context) (bool, error) {
		attempts++
		in.Body = bytes.NewReader(data)
		out, err := s.client.PutObject(ctx, in)
		if err != nil {
			if isPreconditionFailed(err) {
				return false, ErrPreconditionFailed
			}
			// If-Match on a missing object answers 404 NoSuchKey on
			// S3 and versitygw: the condition is false.
			if opts.IfMatch != "" && isNoSuchKey(err) {
				return false, ErrPreconditionFailed
			}
			// versitygw (posix) also answers ExistingObjectIsDirectory
			// when a DELETE of the last other key in the PUT's folder
			// removed the folder under it: it reports any failure to
			// make the folder or link the object into it that way.
			// Nothing was written, and one more try recreates the
			// folder. A key that really is a folder fails again.
			if !folderRetry && errorCode(err) == "ExistingObjectIsDirectory" {
				folderRetry = true
				return true, err
			}
			// A write cut short by the caller (cancelled) is not tried
			// again, but may have been applied all the same.
			retry, maybeApplied := classify(err)
			if maybeApplied {
				ambiguous = true
			}
			return retry, err
		}
		etag = aws.ToString(out.ETag)
		return false, nil
	})
	if err == nil && etag == "" {
		// Every compare-and-swap is conditional on the ETag a write
		// returned, and an empty one would make the next If-Match
		// unconditional (the lease's renewal would overwrite a new
		// holder's). The write landed, but is refused as not confirmed:
		// a store without ETags cannot hold PicoMQ's state.
		return "", &unknownOutcomeError{err: fmt.Errorf("segment: put %s: the store answered without an ETag, "+
			"which PicoMQ's compare-and-swap writes need: use a store that returns one", key)}
	}
	if err == nil {
		return etag, nil
	}
	if conditional && attempts > 1 && errors.Is(err, ErrPreconditionFailed) {
		return s.resolveRetriedPut(ctx, key, data, opts, ambiguous)
	}
	if ambiguous {
		// An attempt may have landed, whatever the last one answered.
		return "", &unknownOutcomeError{err: err}
	}
	return "", err
}

// resolveRetriedPut decides a conditional Put whose retry found the
// condition false: if the object holds exactly our bytes, an earlier
// attempt of ours landed. That holds even when no failure left the
// outcome open (ambiguous false): a gateway in front of the store can
// answer 503, 429 or 409 after forwarding a request the store applied,
// and the condition then fails on our own object. So an object that
// cannot be read back leaves the outcome open in any case. Otherwise,
// unless an attempt may have been applied, the failed condition stands.
func (s *S3Store) resolveRetriedPut(ctx context.Context, key string, data []byte, opts PutOptions, ambiguous bool) (string, error) {
	cur, etag, err := s.Get(ctx, key, 0, -1)
	switch {
	case err == nil && bytes.Equal(cur, data):
		return etag, nil
	case err != nil && !errors.Is(err, ErrNotFound):
		return "", fmt.Errorf("segment: put %s: %w (checking it: %v)", key, ErrUnknownOutcome, err)
	case !ambiguous:
		return "", ErrPreconditionFailed
	case opts.IfNoneMatch:
		// The key holds other data (or is gone again): someone else's
		// create won; ours, landed or not, is not what is there now.
		if errors.Is(err, ErrNotFound) {
			return "", fmt.Errorf("segment: put %s: %w", key, ErrUnknownOutcome)
		}
		return "", ErrPreconditionFailed
	default:
		// Our compare-and-swap may have landed and been replaced since.
		return "", fmt.Errorf("segment: put %s: %w", key, ErrUnknownOutcome)
	}
}

// Get implements Store.
func (s *S3Store) Get(ctx context.Context, key string, offset, length int64) ([]byte, string, error) {
	return s.get(ctx, key, offset, length, nil)
}

// GetBuffer implements BufferGetter.
func (s *S3Store) GetBuffer(ctx context.Context, key string, alloc func(n int) []byte) ([]byte, error) {
	data, _, err := s.get(ctx, key, 0, -1, alloc)
	return data, err
}

// get reads a range of key; alloc, when set, supplies the buffer of a body
// of announced size.
func (s *S3Store) get(ctx context.Context, key string, offset, length int64, alloc func(n int) []byte) ([]byte, string, error) {
	if key == "" {
		return nil, "", errors.New("segment: empty key")
	}
	if offset < 0 {
		return nil, "", fmt.Errorf("segment: get %s: negative offset %d", key, offset)
	}
	if length == 0 {
		etag, err := s.head(ctx, key)
		return []byte{}, etag, err
	}
	in := &s3.GetObjectInput{
		Bucket: aws.String(s.bucket),
		Key:    aws.String(s.full(key)),
	}
	ranged := offset > 0 || length > 0
	if ranged {
		if length > 0 {
			in.Range = aws.String("bytes=" + strconv.FormatInt(offset, 10) + "-" + strconv.FormatInt(offset+length-1, 10))
		} else {
			in.Range = aws.String("bytes=" + strconv.FormatInt(offset, 10) + "-")
		}
	}
	var data []byte
	var etag string
	pastEnd := false
	err := s.do(ctx, OpGet, key, func(ctx context.Context) (bool, error) {
		out, err := s.client.GetObject(ctx, in)
		if err != nil {
			if isNoSuchKey(err) {
				return false, ErrNotFound
			}
			if ranged && httpStatus(err) == http.StatusRequestedRangeNotSatisfiable {
				pastEnd = true
				return false, nil
			}
			retry, _ := classify(err)
			return retry, err
		}
		defer out.Body.Close()
		// The body is read inside the attempt so a stalled transfer
		// is cut off by the attempt timeout and retried.
		b, err := readBody(out.Body, aws.ToInt64(out.ContentLength), alloc)
		if err != nil {
			return true, err
		}
		if ranged && out.ContentRange == nil {
			// The server ignored the Range header and sent the whole
			// object.
			b = sliceRange(b, offset, length)
		}
		data, etag = b, aws.ToString(out.ETag)
		return false, nil
	})
	if err != nil {
		return nil, "", err
	}
	if pastEnd {
		// S3 answers 416 for a range that starts at or past the end; the
		// contract is an empty read of an existing object.
		etag, err := s.head(ctx, key)
		return []byte{}, etag, err
	}
	return data, etag, nil
}

// readBody reads a response body, into one buffer of the announced size
// when there is one: ReadAll would grow its way up to a 4 MiB data object
// in a dozen copies.
func readBody(body io.Reader, size int64, alloc func(n int) []byte) ([]byte, error) {
	if size <= 0 {
		return io.ReadAll(body)
	}
	var b []byte
	if alloc != nil {
		b = alloc(int(size))
	} else {
		b = make([]byte, size)
	}
	if _, err := io.ReadFull(body, b); err != nil {
		return nil, err
	}
	return b, nil
}

func sliceRange(b []byte, offset, length int64) []byte {
	if offset >= int64(len(b)) {
		return []byte{}
	}
	b = b[offset:]
	if length >= 0 && length < int64(len(b)) {
		b = b[:length]
	}
	return b
}

func (s *S3Store) head(ctx context.Context, key string) (string, error) {
	var etag string
	err := s.do(ctx, OpHead, key, func(ctx context.Context) (bool, error) {
		out, err := s.client.HeadObject(ctx, &s3.HeadObjectInput{
			Bucket: aws.String(s.bucket),
			Key:    aws.String(s.full(key)),
		})
		if err != nil {
			if isNoSuchKey(err) {
				return false, ErrNotFound
			}
			retry, _ := classify(err)
			return retry, err
		}
		etag = aws.ToString(out.ETag)
		return false, nil
	})
	return etag, err
}

// List implements Store. max <= 0 means 1,000.
func (s *S3Store) List(ctx context.Context, prefix, startAfter string, max int) ([]ObjectInfo, bool, error) {
	if max <= 0 {
		max = 1000
	}
	in := &s3.ListObjectsV2Input{
		Bucket: aws.String(s.bucket),
		Prefix: aws.String(s.full(prefix)),
	}
	if startAfter != "" {
		in.StartAfter = aws.String(s.full(startAfter))
	}
	var objs []ObjectInfo
	for {
		in.MaxKeys = aws.Int32(int32(min(max-len(objs), 1000)))
		var out *s3.ListObjectsV2Output
		err := s.do(ctx, OpList, prefix, func(ctx context.Context) (bool, error) {
			var err error
			out, err = s.client.ListObjectsV2(ctx, in)
			if err != nil {
				retry, _ := classify(err)
				return retry, err
			}
			return false, nil
		})
		if err != nil {
			return nil, false, err
		}
		for _, o := range out.Contents {
			k := aws.ToString(o.Key)
			if !strings.HasPrefix(k, s.prefix) || strings.HasSuffix(k, "/") {
				// Not ours, or a folder marker some stores list.
				continue
			}
			objs = append(objs, ObjectInfo{
				Key:  k[len(s.prefix):],
				Size: aws.ToInt64(o.Size),
				ETag: aws.ToString(o.ETag),
			})
		}
		truncated := aws.ToBool(out.IsTruncated)
		if !truncated {
			return objs, false, nil
		}
		if len(objs) >= max {
			return objs[:max], true, nil
		}
		if tok := aws.ToString(out.NextContinuationToken); tok != "" {
			in.ContinuationToken = aws.String(tok)
			in.StartAfter = nil
		} else if len(out.Contents) > 0 {
			// Paged on by key alone: a token kept from an earlier page
			// would take the store back there.
			in.StartAfter = out.Contents[len(out.Contents)-1].Key
			in.ContinuationToken = nil
		} else {
			return nil, false, fmt.Errorf("segment: list %s: truncated listing without a continuation token", prefix)
		}
	}
}

// Delete implements Store. Keys go out in DeleteObjects requests of up to
// 1,000; a key the store refuses to delete is reported with its error code.
func (s *S3Store) Delete(ctx context.Context, keys []string) error {
	var errs []error
	for start := 0; start < len(keys); start += deleteBatch {
		batch := keys[start:min(start+deleteBatch, len(keys))]
		ids := make([]s3types.ObjectIdentifier, 0, len(batch))
		for _, k := range batch {
			if k == "" {
				errs = append(errs, errors.New("segment: delete: empty key"))
				continue
			}
			ids = append(ids, s3types.ObjectIdentifier{Key: aws.String(s.full(k))})
		}
		if len(ids) == 0 {
			continue
		}
		in := &s3.DeleteObjectsInput{
			Bucket: aws.String(s.bucket),
			Delete: &s3types.Delete{Objects: ids, Quiet: aws.Bool(true)},
		}
		// A 200 answer can still refuse some keys, each with its own
		// code: those refused for now (InternalError, SlowDown) go again
		// with the backoff of a failed request, alone; the others are
		// refused for good, and reported.
		err := s.do(ctx, OpDelete, "", func(ctx context.Context) (bool, error) {
			out, err := s.client.DeleteObjects(ctx, in)
			if err != nil {
				retry, _ := classify(err)
				return retry, err
			}
			var again []s3types.ObjectIdentifier
			var failed []error
			for _, e := range out.Errors {
				code := aws.ToString(e.Code)
				if code == "NoSuchKey" {
					continue
				}
				keyErr := fmt.Errorf("segment: delete %s: %s: %s",
					strings.TrimPrefix(aws.ToString(e.Key), s.prefix), code, aws.ToString(e.Message))
				if retry, _, _ := classifyCode(code); retry {
					again = append(again, s3types.ObjectIdentifier{Key: e.Key})
					failed = append(failed, keyErr)
				} else {
					errs = append(errs, keyErr)
				}
			}
			if len(again) == 0 {
				return false, nil
			}
			in.Delete.Objects = again
			return true, errors.Join(failed...)
		})
		if err != nil {
			return errors.Join(append(errs, err)...)
		}
	}
	return errors.Join(errs...)
}

// DeleteIfMatch implements Store with a DeleteObject carrying If-Match
// (AWS S3 since 2025, versitygw). A store that ignores the header deletes
// unconditionally, which is what Delete does anyway.
func (s *S3Store) DeleteIfMatch(ctx context.Context, key, etag string) error {
	if key == "" {
		return errors.New("segment: delete: empty key")
	}
	if etag == "" {
		return fmt.Errorf("segment: delete %s: empty ETag", key)
	}
	in := &s3.DeleteObjectInput{
		Bucket:  aws.String(s.bucket),
		Key:     aws.String(s.full(key)),
		IfMatch: aws.String(etag),
	}
	return s.do(ctx, OpDelete, key, func(ctx context.Context) (bool, error) {
		_, err := s.client.DeleteObject(ctx, in)
		switch {
		case err == nil:
			return false, nil
		case isPreconditionFailed(err):
			return false, ErrPreconditionFailed
		case isNoSuchKey(err):
			// AWS answers 404 to a conditional delete of a missing key
			// (an earlier attempt of this one may have removed it).
			return false, nil
		}
		retry, _ := classify(err)
		return retry, err
	})
}

// do runs attempt until it succeeds, returns a final error, or runs out of
// attempts. Each attempt gets its own timeout; between attempts it sleeps
// an exponentially growing, fully jittered backoff. Every attempt is
// counted in the store's RequestStats; key is the object key (the prefix of
// a listing, "" for a delete).
func (s *S3Store) do(ctx context.Context, op Op, key string, attempt func(ctx context.Context) (retry bool, err error)) error {
	what := op.String()
	if key != "" {
		what += " " + key
	}
	var err error
	for n := 1; ; n++ {
		if cerr := ctx.Err(); cerr != nil {
			if err == nil {
				err = cerr
			}
			return fmt.Errorf("segment: %s: %w", what, err)
		}
		actx, cancel := context.WithTimeout(ctx, s.opts.RequestTimeout)
		var retry bool
		began := time.Now()
		retry, err = attempt(actx)
		timedOut := actx.Err() != nil && ctx.Err() == nil
		var noCreds *NoCredentialsError
		if errors.As(err, &noCreds) {
			// The request never left: what the SDK wraps around the
			// credentials' error ("operation error S3: GetObject, get
			// identity: get credentials") only hides the reason.
			err = noCreds
		}
		cancel()
		s.opts.Stats.observe(op, key, time.Since(began), outcomeOf(err, timedOut))
		if err == nil {
			return nil
		}
		if errors.Is(err, ErrNotFound) || errors.Is(err, ErrPreconditionFailed) {
			return err
		}
		if ctx.Err() != nil {
			return fmt.Errorf("segment: %s: %w", what, ctx.Err())
		}
		if timedOut {
			// The attempt's own deadline, not the caller's: a stalled
			// request, worth another try.
			retry = true
			err = fmt.Errorf("attempt timed out after %v: %w", s.opts.RequestTimeout, err)
		}
		if !retry || n >= s.opts.MaxAttempts {
			if n > 1 {
				return fmt.Errorf("segment: %s (%d attempts): %w", what, n, err)
			}
			return fmt.Errorf("segment: %s: %w", what, err)
		}
		if !sleep(ctx, s.backoff(n)) {
			return fmt.Errorf("segment: %s: %w", what, ctx.Err())
		}
	}
}

// backoff returns a random duration in [0, min(MaxBackoff, MinBackoff*2^(n-1))].
func (s *S3Store) backoff(n int) time.Duration {
	d := s.opts.MinBackoff
	for i := 1; i < n && d < s.opts.MaxBackoff; i++ {
		d *= 2
	}
	d = min(d, s.opts.MaxBackoff)
	return rand.N(d + 1)
}

func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func httpStatus(err error) int {
	var re *awshttp.ResponseError
	if errors.As(err, &re) {
		return re.HTTPStatusCode()
	}
	return 0
}

func errorCode(err error) string {
	var ae smithy.APIError
	if errors.As(err, &ae) {
		return ae.ErrorCode()
	}
	return ""
}

func isPreconditionFailed(err error) bool {
	return httpStatus(err) == http.StatusPreconditionFailed || errorCode(err) == "PreconditionFailed"
}

func isNoSuchKey(err error) bool {
	switch errorCode(err) {
	case "NoSuchKey", "NotFound":
		return true
	case "NoSuchBucket":
		return false
	}
	var nf *s3types.NoSuchKey
	if errors.As(err, &nf) {
		return true
	}
	return httpStatus(err) == http.StatusNotFound && errorCode(err) == ""
}

// Transient reports whether err, from a call on an S3Store, says the store
// could not be reached or failed on its side: a network error, a timeout,
// throttling, a 5xx. Such a condition passes by itself, unlike a refusal
// (access denied, no such bucket, a bad certificate) that needs the
// operator.
func Transient(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) {
		return false
	}
	// A local file's error (a node id, a file:// store) is not the
	// store's: classify would take its errno for a network error.
	var pathErr *fs.PathError
	if errors.As(err, &pathErr) {
		return false
	}
	retry, _ := classify(err)
	return retry
}

// classifyCode is classify for the S3 error codes that say the failure
// passes by itself; known is false for every other code.
func classifyCode(code string) (retry, maybeApplied, known bool) {
	switch code {
	case "SlowDown", "Throttling", "ThrottlingException", "ThrottledException",
		"RequestThrottled", "RequestThrottledException", "TooManyRequests",
		"TooManyRequestsException", "ProvisionedThroughputExceededException",
		"RequestLimitExceeded", "BandwidthLimitExceeded", "ServiceUnavailable",
		"RequestTimeout", "RequestTimeoutException", "PriorRequestNotComplete",
		// A concurrent conditional write to the same key was in
		// flight; nothing was written.
		"ConditionalRequestConflict", "OperationAborted":
		return true, false, true
	case "InternalError", "InternalFailure":
		return true, true, true
	}
	return false, false, false
}

// classify says whether a failed request is worth retrying, and whether it
// may have been applied although it failed (so a retry of a conditional
// write can find its own earlier write).
func classify(err error) (retry, maybeApplied bool) {
	if errors.Is(err, context.Canceled) {
		return false, true
	}
	// No credentials: the request was never sent, and the chain that
	// found none is not read again. (An instance role that fails to
	// refresh keeps its last keys for a while: the SDK covers a metadata
	// service's hiccup itself.)
	var noCreds *NoCredentialsError
	if errors.As(err, &noCreds) {
		return false, false
	}
	// A request refused for the time it was signed at (a 403
	// RequestTimeTooSkewed) when the answer's Date says our clock is off
	// by minutes: the SDK has taken the offset from that answer and signs
	// the next attempt with the server's time, and marks the error
	// retryable for its own retryer, which ours replaces. Nothing was
	// applied: a 4xx is a refusal.
	var skewed interface{ RetryableError() bool }
	if errors.As(err, &skewed) && skewed.RetryableError() && httpStatus(err)/100 == 4 {
		return true, false
	}
	if retry, maybeApplied, known := classifyCode(errorCode(err)); known {
		return retry, maybeApplied
	}
	if status := httpStatus(err); status != 0 {
		switch {
		case status == http.StatusTooManyRequests, status == http.StatusServiceUnavailable:
			return true, false
		case status == http.StatusConflict:
			// Only the conflict codes above are transient: versitygw
			// also answers 409 for a key that collides with a folder
			// (ExistingObjectIsDirectory, ObjectParentIsFile), which
			// no retry can fix.
			return errorCode(err) == "", false
		case status >= 500:
			return true, true
		default:
			return false, false
		}
	}
	// The server's certificate failed verification: a setting to fix
	// (AWS_CA_BUNDLE, the endpoint's host name), which no retry changes.
	var certErr *tls.CertificateVerificationError
	if errors.As(err, &certErr) {
		return false, false
	}
	// No HTTP answer: a transport error.
	var opErr *net.OpError
	if errors.As(err, &opErr) && opErr.Op == "dial" {
		return true, false // never reached the server
	}
	if errors.Is(err, syscall.ECONNREFUSED) {
		return true, false
	}
	var netErr net.Error
	if errors.As(err, &netErr) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, context.DeadlineExceeded) {
		return true, true
	}
	var sendErr *smithyhttp.RequestSendError
	if errors.As(err, &sendErr) {
		return true, true
	}
	return false, true
}
