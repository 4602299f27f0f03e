// Command caddy is Caddy with its standard modules and PicoMQ, the build
// xcaddy would produce with --with github.com/picomq/caddy-picomq.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	// Caddy's standard modules.
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	// PicoMQ: the picomq handler, directive and app.
	_ "github.com/picomq/caddy-picomq"
)

func main() {
	caddycmd.Main()
}
