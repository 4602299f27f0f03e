// Package integration holds end-to-end tests of the picomq module: each test
// runs Caddy (built from ./cmd/caddy) as a child process on a versitygw
// bucket, usually reached through testenv's fault-injecting S3 proxy, and
// talks to it over HTTP only, the way Durable Streams clients do.
//
// The tests crash Caddy with SIGKILL, stop it with SIGTERM, reload its
// configuration and start a second process on the same storage, and check
// the invariants of the design (ack means durable, readers never see what a
// crash could take back, offsets never change, one writer per storage).
//
// The package has no code outside its tests; this file only documents it.
package integration
