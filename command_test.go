package picomq

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// benchServer is a server that counts the requests it gets and answers
// every one with 404.
func benchServer(t *testing.T) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		http.NotFound(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv, &n
}

// execBench runs `caddy picomq bench` with args, its output discarded.
func execBench(t *testing.T, args ...string) error {
	t.Helper()
	cmd := benchCommand()
	cmd.SetArgs(append([]string{"--quiet"}, args...))
	cmd.SetOut(io.Discard)
	cmd.SetErr(io.Discard)
	return cmd.Execute()
}

// Bad input to the bench command fails it with a message naming the flag,
// before any request reaches the server.
func TestBenchCommandRefusesBadInput(t *testing.T) {
	srv, requests := benchServer(t)
	base := srv.URL + "/"
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"unknown mode", []string{"--url", base, "--mode", "soak"}, `unknown mode "soak"`},
		{"zero writers", []string{"--url", base, "--writers", "0"}, "--writers 0: want at least 1"},
		{"negative streams", []string{"--url", base, "--streams", "-5"}, "--streams -5: want at least 1"},
		{"negative size", []string{"--url", base, "--size", "-1"}, `size "-1"`},
		{"zero duration", []string{"--url", base, "--duration", "0s"}, "--duration 0s: want more than 0"},
		{"negative rate", []string{"--url", base, "--rate", "-1"}, "--rate -1: want 0 or more"},
		{"zero timeout", []string{"--url", base, "--timeout", "0s"}, "--timeout 0s: want more than 0"},
		{"negative timeout", []string{"--url", base, "--timeout", "-1s"}, "--timeout -1s: want more than 0"},
		{"zero readers", []string{"--url", base, "--mode", "read", "--stream", "s", "--readers", "0"}, "--readers 0: want at least 1"},
		{"negative readers", []string{"--url", base, "--mode", "read", "--stream", "s", "--readers", "-3"}, "--readers -3: want at least 1"},
		{"no url", nil, "--url is required"},
		{"not http", []string{"--url", "ftp://example.invalid/"}, "want an http:// or https:// URL"},
		{"no host", []string{"--url", "http://"}, "no host"},
		{"no path", []string{"--url", srv.URL}, "end it with a slash"},
		{"pid of no process", []string{"--url", base, "--pid", "caddy=1073741824"}, "--pid caddy=1073741824: cannot read the process"},
		{"pid without a name", []string{"--url", base, "--pid", "1234"}, "want NAME=PID"},
		{"an argument", []string{"--url", base, "append"}, `unknown command "append"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := requests.Load()
			err := execBench(t, tt.args...)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %v, want one containing %q", err, tt.want)
			}
			if n := requests.Load() - before; n != 0 {
				t.Errorf("the server got %d requests before the input was refused", n)
			}
		})
	}
}
