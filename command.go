package picomq

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"runtime/pprof"
	"slices"
	"strings"
	"syscall"
	"time"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/picomq/caddy-picomq/loadgen"
)

// The `caddy picomq` command and its `bench` subcommand live in the root
// package so that every build with the module (xcaddy included) has them.
// The load generator itself is package loadgen, which knows nothing of
// Caddy.
func init() {
	caddycmd.RegisterCommand(caddycmd.Command{
		Name:  "picomq",
		Usage: "<command> [flags]",
		Short: "PicoMQ tools (bench: a Durable Streams load generator)",
		Long: `
PicoMQ tools. Subcommands:

  bench   load-generate against any Durable Streams URL and report
          throughput, latency, errors and the CPU and memory of the
          processes named with --pid

See 'caddy picomq bench --help'.`,
		CobraFunc: func(cmd *cobra.Command) {
			cmd.Args = cobra.NoArgs
			cmd.RunE = func(cmd *cobra.Command, _ []string) error { return cmd.Help() }
			cmd.AddCommand(benchCommand())
		},
	})
}

func benchCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "bench --url URL [flags]",
		Short: "Load-generate against a Durable Streams server",
		Long: `
Drives any Durable Streams URL (this module, a Caddy 'respond' route, the
Node reference server) over plain HTTP and reports ops, ops/s, MB/s,
latency percentiles, errors, and the CPU time and RSS of this process and of
every --pid process over the measured window.

Stream i is URL + prefix + i. Modes:

  append    --writers goroutines append --size bodies to --streams streams
            (writer w takes the streams s with s mod writers == w, round-
            robin; with fewer streams than writers, stream w mod streams),
            closed loop, or open loop at --rate appends/s in total
  sse       --subscribers SSE readers on stream prefix+"0" from its tail;
            one writer appends numbered records at --rate (default 20/s, open
            loop: each at its time, not waiting for the last); reports
            delivered/expected, lost, and latency from the append's ack to
            receipt; --protocol pico has the feeds speak PicoMQ's Pico
            protocol instead of Durable Streams
  read      --readers goroutines read --stream (a full name) from offset -1
            to the tail with plain GETs
  populate  create --streams streams with one deterministic --size record each
  verify    read them back and compare

A progress line goes to stderr every second (its p99 is of that last
second); the summary to stdout. The
exit status is non-zero when verify finds a stream mismatched or
unreadable, and when errors leave a run nothing to measure (no operation
succeeded; in sse mode, no record reached a subscriber).`,
		// The examples run as written against examples/Caddyfile (and the
		// Pico one against examples/pico.Caddyfile): their site is
		// http://localhost:4437, so a URL of 127.0.0.1 would not match its
		// host and get Caddy's empty 200 to every request.
		Example: `  # against examples/Caddyfile:
  caddy picomq bench --url http://localhost:4437/ --writers 64 --streams 100 --size 1KiB --duration 30s
  caddy picomq bench --url http://localhost:4437/ --mode sse --subscribers 5000 --rate 20 --duration 30s
  caddy picomq bench --url http://localhost:4437/ --mode populate --streams 100000 --prefix pop-
  caddy picomq bench --url http://localhost:4437/ --mode verify --streams 100000 --prefix pop-
  caddy picomq bench --url http://localhost:4437/ --mode read --stream pop-17 --readers 4
  # Pico feeds, against examples/pico.Caddyfile:
  caddy picomq bench --url http://localhost:4437/pico/ --mode sse --protocol pico --subscribers 5000 --rate 20 --duration 30s`,
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: false,
	}
	f := cmd.Flags()
	f.String("url", "", "base URL with a path (at least /); stream i is URL + prefix + i (required)")
	f.String("prefix", "", `stream-name prefix (default "bench-" + 6 random characters)`)
	f.String("mode", loadgen.ModeAppend, "append | sse | read | populate | verify")
	f.Int("writers", loadgen.DefaultWriters, "concurrent writers (append), workers (populate, verify)")
	f.Int("streams", loadgen.DefaultStreams, "number of streams (append, populate, verify)")
	f.String("size", "1024", "bytes per append or record (1KiB, 1MiB accepted)")
	f.Duration("duration", loadgen.DefaultDuration, "measured window (append, sse)")
	f.Duration("warmup", 0, "load before the measured window, not measured (append, sse)")
	f.Float64("rate", 0, "total appends/s (0: closed loop; sse mode defaults to 20)")
	f.String("content-type", loadgen.DefaultContentType, "stream content type (sse mode defaults to text/plain)")
	f.Bool("create", true, "PUT each stream first (201 or 200 both fine); populate with --create=false POSTs its record to streams that exist")
	f.Int("subscribers", 0, "SSE readers (sse mode)")
	f.String("protocol", loadgen.ProtocolDurableStreams, "sse mode: the feeds' protocol, durable-streams or pico (PicoMQ's own; URL then names a picomq handler with protocol pico)")
	f.String("stream", "", "read mode: the existing stream to read (full name, no prefix)")
	f.Int("readers", 1, "read mode: parallel readers of --stream")
	f.StringArray("header", nil, `"NAME: VALUE": send this header with every request to the server, as curl -H does (repeatable), e.g. an Authorization for a site behind auth; "Host: NAME" sets the Host`)
	f.String("cacert", "", "PEM file of the certificate authorities an https:// --url must chain to, in place of the system's (a staging CA, or Caddy's local one for tls internal)")
	f.StringArray("pid", nil, "NAME=PID: report that process's CPU time, minor page faults and RSS (end and peak) over the window, from /proc (repeatable)")
	f.String("mark", "", "POST URL?phase=start and URL?phase=end at the window's edges (failures are fatal)")
	f.String("json", "", "write the result as JSON to FILE (- for stdout, instead of the text summary)")
	f.Duration("timeout", loadgen.DefaultTimeout, "per-request timeout")
	f.Bool("quiet", false, "no progress line")
	f.String("cpuprofile", "", "write this process's CPU profile to FILE (the load generator shares the machine; see what it costs)")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		return runBench(cmd)
	}
	return cmd
}

func runBench(cmd *cobra.Command) error {
	f := cmd.Flags()
	str := func(name string) string { v, _ := f.GetString(name); return v }
	num := func(name string) int { v, _ := f.GetInt(name); return v }
	dur := func(name string) time.Duration { v, _ := f.GetDuration(name); return v }
	cfg := loadgen.Config{
		URL:         str("url"),
		Prefix:      str("prefix"),
		Mode:        str("mode"),
		Writers:     num("writers"),
		Streams:     num("streams"),
		Duration:    dur("duration"),
		Warmup:      dur("warmup"),
		ContentType: str("content-type"),
		Subscribers: num("subscribers"),
		Protocol:    str("protocol"),
		Stream:      str("stream"),
		Readers:     num("readers"),
		Mark:        str("mark"),
		Timeout:     dur("timeout"),
	}
	if cfg.Timeout <= 0 {
		// loadgen takes 0 for its default; from the command line it is a
		// mistake, or a wish for no timeout that the bench does not grant.
		return fmt.Errorf("--timeout %s: want more than 0", cfg.Timeout)
	}
	var err error
	if cfg.Size, err = loadgen.ParseSize(str("size")); err != nil {
		return err
	}
	cfg.Rate, _ = f.GetFloat64("rate")
	cfg.Create, _ = f.GetBool("create")
	headers, _ := f.GetStringArray("header")
	for _, h := range headers {
		name, value, err := loadgen.ParseHeader(h)
		if err != nil {
			return err
		}
		if cfg.Header == nil {
			cfg.Header = http.Header{}
		}
		cfg.Header.Add(name, value)
	}
	if file := str("cacert"); file != "" {
		pem, err := os.ReadFile(file)
		if err != nil {
			return fmt.Errorf("--cacert: %w", err)
		}
		if cfg.RootCAs, err = loadgen.ParseCACert(pem); err != nil {
			return fmt.Errorf("--cacert %s: %w", file, err)
		}
	}
	mode := cmp.Or(cfg.Mode, loadgen.ModeAppend)
	if cfg.Mode == loadgen.ModeSSE && !f.Changed("content-type") {
		cfg.ContentType = "text/plain"
	}
	// Refused input is reported alone: a warning that a flag is ignored,
	// above the error that refuses the run over it, would say the opposite.
	if err := cfg.Check(); err != nil {
		return err
	}
	if unused := unusedFlags(f, mode); len(unused) > 0 {
		// The run goes on (a script may pass one set of flags to every
		// mode), but a user who expected --streams 10 to shape a read is
		// told it did not.
		fmt.Fprintf(cmd.ErrOrStderr(), "bench: warning: %s mode does not use %s; ignored\n",
			mode, strings.Join(unused, ", "))
	}
	pids, _ := f.GetStringArray("pid")
	for _, p := range pids {
		np, err := loadgen.ParsePID(p)
		if err != nil {
			return err
		}
		cfg.PIDs = append(cfg.PIDs, np)
	}
	if quiet, _ := f.GetBool("quiet"); !quiet {
		cfg.Progress = os.Stderr
		if st, err := os.Stderr.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
			cfg.ProgressTTY = true
		}
	}
	jsonPath := str("json")
	var jsonFile *os.File
	if jsonPath != "" && jsonPath != "-" {
		// Opened before the run, not after it: a path that cannot be
		// written is told at once, not after minutes of load.
		if jsonFile, err = os.Create(jsonPath); err != nil {
			return fmt.Errorf("--json: %w", err)
		}
		defer func() {
			if jsonFile != nil {
				// No result written: leave no empty file that a
				// script would take for one.
				jsonFile.Close()
				os.Remove(jsonPath)
			}
		}()
	}

	if path := str("cpuprofile"); path != "" {
		pf, err := os.Create(path)
		if err != nil {
			return fmt.Errorf("--cpuprofile: %w", err)
		}
		defer pf.Close()
		if err := pprof.StartCPUProfile(pf); err != nil {
			return fmt.Errorf("cpu profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	res, runErr := loadgen.Run(ctx, cfg)
	if res != nil && runErr != nil {
		res.Failure = runErr.Error() // with the figures, so a reader of the JSON alone sees them partial
	}
	if res != nil {
		if jsonPath != "-" {
			res.WriteSummary(cmd.OutOrStdout())
		}
		if jsonPath != "" {
			if err := writeResultJSON(res, jsonFile, cmd.OutOrStdout()); err != nil {
				return fmt.Errorf("--json: %w", err)
			}
			jsonFile = nil // written and closed: keep it
		}
	}
	if runErr != nil {
		return fmt.Errorf("bench: %w", runErr)
	}
	// A run that failed at what it was for exits non-zero, so that a
	// script (or CI) running verify, or a run against a server that is
	// down, does not take it for a success; the figures are written first.
	if res != nil {
		if err := res.Check(); err != nil {
			return fmt.Errorf("bench: %w", err)
		}
	}
	return nil
}

// unusedFlags returns, as "--name", the flags given on the command line
// that mode does not read. Only flags given count (Visit skips defaults),
// and none for a mode Run will refuse.
func unusedFlags(f *pflag.FlagSet, mode string) []string {
	if !slices.Contains([]string{loadgen.ModeAppend, loadgen.ModeSSE, loadgen.ModeRead, loadgen.ModePopulate, loadgen.ModeVerify}, mode) {
		return nil
	}
	var unused []string
	f.Visit(func(fl *pflag.Flag) {
		if !loadgen.FlagUsed(mode, fl.Name) {
			unused = append(unused, "--"+fl.Name)
		}
	})
	return unused
}

// writeResultJSON writes res to f, the --json file, or to stdout when f is
// nil (--json -).
func writeResultJSON(res *loadgen.Result, f *os.File, stdout io.Writer) error {
	if f == nil {
		return res.WriteJSON(stdout)
	}
	if err := res.WriteJSON(f); err != nil {
		return err
	}
	return f.Close()
}
