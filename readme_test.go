package picomq

import (
	"os"
	"regexp"
	"strings"
	"testing"
)

// TestReadmeSetUp holds the README's set-up part to what a newcomer on a
// fresh machine relies on: the chapters in their order, one command that
// builds Caddy with this module at the Caddy version go.mod pins and runs
// an example, and one test command, the very line .ci/run ends with.
func TestReadmeSetUp(t *testing.T) {
	readme := readFile(t, "README.md")
	gomod := readFile(t, "go.mod")
	ci := readFile(t, ".ci/run")

	t.Run("chapters", func(t *testing.T) {
		at := 0
		for _, h := range []string{"## Set up", "## Caddyfile", "## Architecture", "## Status"} {
			i := strings.Index(readme[at:], "\n"+h+"\n")
			if i < 0 {
				t.Fatalf("README has no %q heading after byte %d", h, at)
			}
			at += i + 1
		}
	})

	setUp := readme[strings.Index(readme, "\n## Set up\n"):]
	setUp = setUp[:strings.Index(setUp, "\n### ")]
	cmds := shellLines(setUp)

	t.Run("build", func(t *testing.T) {
		caddy := regexp.MustCompile(`(?m)^\s*github\.com/caddyserver/caddy/v2 (v\S+)`).FindStringSubmatch(gomod)
		if caddy == nil {
			t.Fatal("go.mod does not require github.com/caddyserver/caddy/v2")
		}
		var builds []string
		for _, c := range cmds {
			if strings.Contains(c, "xcaddy") {
				builds = append(builds, c)
			}
		}
		if len(builds) != 1 {
			t.Fatalf("want one xcaddy build command in Set up, got %d: %q", len(builds), builds)
		}
		for _, want := range []string{
			" build " + caddy[1] + " ",
			"--with github.com/picomq/caddy-picomq@v0.0.0=.",
			"./caddy run --config examples/",
		} {
			if !strings.Contains(builds[0], want) {
				t.Errorf("build command lacks %q: %s", want, builds[0])
			}
		}
	})

	t.Run("test", func(t *testing.T) {
		lines := strings.Split(strings.TrimSpace(ci), "\n")
		last := strings.TrimSpace(lines[len(lines)-1])
		if !strings.HasPrefix(last, "go test ") {
			t.Fatalf(".ci/run does not end with a go test command: %q", last)
		}
		var tests []string
		for _, c := range cmds {
			if strings.HasPrefix(c, "go test ") {
				tests = append(tests, c)
			}
		}
		if len(tests) != 1 || tests[0] != last {
			t.Errorf("Set up's test commands %q; want exactly .ci/run's %q", tests, last)
		}
	})
}

// shellLines returns the commands in the sh code blocks of md, one per
// line, without comments.
func shellLines(md string) []string {
	var out []string
	in := false
	for _, line := range strings.Split(md, "\n") {
		switch {
		case strings.HasPrefix(line, "```sh"):
			in = true
		case strings.HasPrefix(line, "```"):
			in = false
		case in:
			if c, _, _ := strings.Cut(line, " #"); strings.TrimSpace(c) != "" {
				out = append(out, strings.TrimSpace(c))
			}
		}
	}
	return out
}

func readFile(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
