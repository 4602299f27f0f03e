//go:build linux

package main

import (
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/picomq/caddy-picomq/internal/caddytest"
	"github.com/picomq/caddy-picomq/internal/testenv"
)

// settings are what a row tunes beyond its load: directives of the picomq
// Caddyfile block, and the delay the S3 proxy adds to every request.
type settings struct {
	Directives []string
	Latency    time.Duration // fixed delay per S3 request
	Jitter     time.Duration // plus a random delay in [0, Jitter)
	// Why is the row's Reason cell after its verdict: a sentence or two
	// on why it is tuned the way it is, or on what bounds it when it
	// misses. The evidence goes in Note.
	Why string
	// Note is the full explanation, with the measurements behind it,
	// shown in the row's section.
	Note string
	// Tried lists changes measured on the profiling rig that did not move
	// the row, with their figures, so nobody spends a day on them again.
	// It is shown in the row's section only.
	Tried string
}

// rowOneTuning is row 1's tuning for appends/s, which rows 4, 9 and the
// sweep share.
var rowOneTuning = []string{"flush_interval 5ms", "flush_quiet 300us"}

// rowSettings is the one place to tune the rows. Latency and S3 request
// count pull against each other (a shorter flush_interval means more PUTs),
// so a row may set flush_interval/flush_size as a user tuning for that goal
// would; "1-defaults" stays at the module's defaults.
var rowSettings = map[string]settings{
	"1": {Directives: rowOneTuning,
		Why: "Tuned for appends/s. What bounds it is the box: versitygw and the S3 proxy run on the 2 cores the ceiling gives to Caddy " +
			"and the load generator alone, and an append costs about 195 us of CPU across the four processes against 83 us for a ceiling " +
			"request, so both cores busy would give about 10,000 appends/s; each closed-loop writer also waits a WAL PUT (about 4 ms " +
			"under this load) for every append",
		Note: "Tuned: flush_interval 5ms, at most one WAL PUT per 5 ms, and flush_quiet 300us, so that the writers one upload acknowledges " +
			"share the next instead of the first of them taking one alone (on the rig, 15 s runs: 2,377 and 2,418 WAL PUTs against 3,039 and " +
			"3,020 without, at 6,460 and 6,733 appends/s against 6,392 and 6,679: fewer PUTs, not more speed). " +
			"What bounds it on this box: a writer's cycle is a WAL PUT through the proxy (about 4 ms on average under this load) plus the " +
			"round trips of the 63 other writers answered with it, which Caddy and the load generator serve while versitygw and the proxy " +
			"wait, so 64 closed-loop writers get at most 64/(PUT + burst) appends/s; and Caddy, versitygw, the proxy and the " +
			"load generator share the 2 cores the respond ceiling gives to Caddy and the load generator alone. Compaction (a data PUT and a " +
			"checkpoint PUT per stream, every 5-6 s here) takes about a third of the throughput for a second or two each time, which is where the p99 comes from",
		Tried: "flush_interval 2 or 3 ms (more PUTs, more versitygw and proxy CPU, no faster); compaction folding 8 streams at a time instead of 32 " +
			"(p999 55-75 ms against 240-320, but p99 55-59 ms against 29-33); cache_size 16 or 32 MiB, so that compaction runs more often in smaller " +
			"steps (p99 76-85 and 37 ms against 24-25 ms at 64 MiB, same hour); encoding compaction's data objects into a buffer reused from object " +
			"to object instead of fresh memory (compaction's CPU down about 12%, appends/s and p99 inside the rig's run-to-run spread, which for one " +
			"binary was 5,000-6,800 appends/s and p99 24-39 ms); flush_size 16 or 32 KiB, so that a batch goes out before the interval when it " +
			"fills (16 KiB: p99 68-71 ms, with 2.5 times the PUTs and a compaction every 1,000 WAL objects; 32 KiB: p50 7.7 ms against 9.8, p99 31 ms); " +
			"uploads started on a fixed grid, so that a timer firing late does not push every later upload back (4,206 WAL PUTs in 23 s against " +
			"3,850, appends/s 7,128-7,332 against 7,236-7,573: the writers were not waiting on the spacing). The CPU budget on the rig (20 s, " +
			"each process's own figure): 195 us per append across Caddy (98), the load generator (49), versitygw (26) and the proxy (22), " +
			"against 83 us per request for the ceiling (Caddy 41, load generator 42), so even with both cores busy all the time the box " +
			"would do 2 s / 195 us = 10,300 appends/s, under half of that run's ceiling of 21,580. Of Caddy's 98 us, the HTTP request " +
			"itself costs what it costs the ceiling; the rest is spread over compaction, the S3 client, the garbage collector and the append " +
			"path, none over a tenth. Outside the matrix's layout (2026-12-02, the rig, alternated, 15 s each), Caddy writing straight to " +
			"versitygw instead of through the S3 proxy: 6,450 and 7,352 appends/s against 5,694 and 6,132, p99 31 and 24 ms against 37 " +
			"and 28: the proxy's hop costs this row about a sixth (18% of a core, some 0.9 ms of CPU per PUT, and its latency in every " +
			"writer's cycle), and without it the row is still near 35% of the ceiling. On 2026-12-03 (the rig, 5,102 appends/s), Caddy's " +
			"CPU profile: net/http's connection serving 54% (of which the handler 15%, the engine's append 6.4% of it), the worker pool " +
			"12% (WAL uploads 7.4%, compaction 4.8%), the garbage collector 6.9%, the S3 SDK under 5% in all; per append Caddy 143 us, the " +
			"proxy 31, versitygw 40, the load generator 80, with the box about 75% busy: latency-bound, no PicoMQ hotspot. GOGC=400 for " +
			"Caddy: inside the spread (0-14% stolen between runs). On 2026-12-03 (the rig, 15 s each): one writer alone gets 113 " +
			"appends/s at p50 7.3 ms, its WAL PUTs averaging 4.95 ms in Caddy's upload histogram; 1 KiB PutObjects in a loop through the " +
			"module's S3 client straight to versitygw take p50 1.0-1.6 ms, p90 2.6-5.9 ms on idle cores and 1.3 ms with both kept busy by a " +
			"spinning process (an idle vCPU is slow to wake), and cost versitygw 740 us of CPU each. With compaction kept out of the window " +
			"(its WAL-count trigger raised to 100,000, cache_size 1GiB, a fresh bucket) the load gave 6,170 and 6,047 appends/s at p99 24.5 " +
			"and 25.7 ms with 1.4% stolen, against 5,706 and 6,144 at p99 45.6 and 37.6 ms for the landed code within the hour: compaction " +
			"is where the p99 comes from, but without it the row is still about a third of the ceiling. On 2026-12-03 (the rig, 15 s each, " +
			"alternated, three rounds): classic group commit, one WAL upload in flight at a time and the next starting as it lands (a " +
			"throwaway build with the writer's MaxInFlight at 1, flush_interval 1ms, with and without flush_quiet 300us): 6,061-6,608 and " +
			"6,233-6,590 appends/s against 6,613-6,913 for this row's tuning, with twice the WAL PUTs (a lone upload lands in about 1.5 ms on " +
			"idle cores, but the PUTs back to back take the CPU the HTTP side needs). On 2026-12-04 (the rig, 10-15 s each): flush_interval 3, 4 " +
			"and 5 ms gave 8,517, 8,937 and 7,995-8,694 appends/s, 7 ms a p50 of 7.8 ms against 6.3-6.4; at 5 ms the WAL went out 143 times a " +
			"second, not 200, about 56 appends each, its PUTs averaging 4.27 ms in Caddy's upload histogram against 0.75 ms for the same 56 KiB " +
			"conditional PUT straight to versitygw and 1.06 ms through the proxy on the idle box. The acknowledgements of one batch come back " +
			"after the interval has passed, so the uploads clock themselves at PUT plus the writers' round trip plus flush_quiet, whatever the " +
			"interval: the row would need a PUT that keeps its idle latency with the box 70% busy. On 2026-12-04 (the rig, 15 s each, " +
			"alternated): Caddy alone with GOMAXPROCS=1 spent 84 and 94 us of CPU an append against 114 and 106 at the default of 2, at " +
			"7,650 and 7,100 appends/s against 6,585 and 7,092: with four Go processes on two cores, a runtime that wakes a second processor " +
			"for each readied goroutine pays for it in futex calls and spinning. A setting for a box that shares its cores with the S3 " +
			"server, not for a deployment, so the matrix leaves it at the default; and the S3 proxy's CPU profile under this load (13% of a " +
			"core) is mostly loopback syscalls and the scheduler, nothing the proxy itself could drop. Also on 2026-12-04 (the rig, 15 s " +
			"each, alternated): versitygw and the proxy at nice -10, so that the S3 side's wake-ups are never queued behind Caddy's and " +
			"the load generator's work, as a remote bucket's would not be: 6,914 and 6,194 appends/s against 7,432 and 6,948 at equal " +
			"priority, no gain; the PUT's time under load is not the S3 processes waiting for a core. On 2026-12-06 (the rig, 15 s " +
			"each): Caddy with GOMAXPROCS=4, so that a processor would more often be free to pick up the store's answers while the " +
			"writers' requests keep the others busy: 5,584 appends/s against 6,085 at the default, p99 29.9 ms against 27.3"},
	"1-defaults": {Why: "flush_interval 20ms: at most 50 WAL PUTs/s; latency is about the interval plus a PUT"},
	"2": {Directives: []string{"flush_interval 60ms"},
		Why: "Tuned for cost: flush_interval 60ms caps WAL PUTs at about 17/s; compaction adds a data PUT and a checkpoint per busy stream per cycle",
		Note: "Tuned for cost: flush_interval 60ms caps WAL PUTs at about 17/s. Compaction costs one data PUT and one metadata PUT per " +
			"active stream per cycle, and a cycle starts when the backlog reaches 3/4 of the 64 MiB cache: about 4 requests per 1,000 " +
			"appends of 1 KiB over 100 streams"},
	"2-many": {Why: "Defaults. Many slow streams cost more than a few busy ones: their records go to pack objects shared by hundreds of " +
		"streams, and most of the window's requests are the WAL's PUTs (up to 50 a second at flush_interval 20ms)",
		Note: "Defaults. A compaction packs the new records of each busy stream with little not yet in data objects of its own " +
			"(pack_below 256 KiB) into shared pack objects, up to 4 MiB each, instead of writing it a data object and a checkpoint. At 10 to " +
			"16 compactions or 5 to 10 minutes in the packs (spread by a hash of its name) a stream is repacked into one run of the " +
			"compaction's pack while its packed records are at most half of pack_below, and folded (a data PUT and a checkpoint) past " +
			"half: here, at 0.2 appends/s of 1 KiB, every stream is repacked once, 5 to 10 minutes in, and folded 10 to 20 minutes in. " +
			"The window starts 7 minutes into the load, before the folds: its requests are the WAL's PUTs (at most 50 a second at " +
			"flush_interval 20ms, about 25 per 1,000 appends here) and the packs'. On the rig (versitygw direct, the module's own " +
			"counters, f3a8120 with the half rule), minutes 7 to 22, which hold every stream's first fold: 38.3 requests per 1,000 " +
			"appends (68,877 for 1,800,150; 55.4 in minutes 10 to 15, where most folds fell), p99 209 ms over the 22 minutes, Caddy's " +
			"peak RSS 1,013 MiB (a transient heap, 160 MiB after the load). Before repacks (a338a0b) streams left the packs every 5 to 10 " +
			"minutes: 57.4 per 1,000 in this window. Repacking up to pack_below itself, without the half rule, let 10,000 streams " +
			"growing at one rate pass the limit together 21 minutes in: 20,000 PUTs and the reads of their packs held compaction up " +
			"until the WAL outgrew the cache, it then read the WAL back a GET per entry and never caught up (614,000 GETs in 5 " +
			"minutes, p99 155 s); since fb2b514 a compaction that finds entries gone from the cache reads them back a GET per WAL " +
			"object for all the streams with entries in it, a window of at most 32 MiB of them at a time. Before packs (cc73c1b) this " +
			"row measured 433 requests per 1,000 appends and a p99 of 4.4 s. Memory: a compaction held every record it packed, repacks' " +
			"records read back from older packs included, until its last pack was written, and copied each range it read back; since " +
			"3d5eac0 it lets go of a stream's records once its pack is written, and since fe70678 a range that holds only the runs it " +
			"wants is decoded in place. bench/run -rows 2,8 at 7512710 (2026-12-05 22:05 UTC): Caddy's RSS over this window 257 MiB, " +
			"peak 384, 286,777 minor faults, 65.1 s of CPU, p99 121 ms, 29.3 requests per 1,000 appends, against 867 MiB, peak 867, " +
			"460,523 faults, 69.5 s, 199 ms and 29.2 in the matrix at 15e84b8"},
	"3": {Latency: 25 * time.Millisecond,
		Why: "Defaults. Throughput is bound by the box's CPU, as in row 1. The p99 target sits at the ceiling's own p99 for the same " +
			"1,024 closed-loop writers: at half the ceiling's rate they wait 1,024 / rate, about 90 ms, on average, and the p99 of " +
			"such a load is about twice its mean, the ceiling's included",
		Note: "Defaults; the proxy adds 25 ms to every S3 request. " +
			"A compaction starts when the backlog reaches 3/4 of the 64 MiB cache, here every 7-10 s. It folded each of the 1,000 streams with a " +
			"data PUT and a checkpoint PUT, about 2,000 PUTs per cycle, seven times the WAL's own; since packs (f943223) their few records per " +
			"cycle go into shared packs instead, the window's PUTs are the WAL's (930 in 20 s at d8d03d7), and appends/s stayed where they were " +
			"(41.9% against 39% at cc73c1b): this row is bound by the box's CPU, not by the bucket's requests. " +
			"Before 7bbdf8b compaction folded 8 at a time and fell behind for good (the WAL grew by 40 objects a second), " +
			"which this 20 s window showed as a higher figure (41% at 2ebfc5d). The p99 target is below what 1,024 closed-loop writers " +
			"see even from the respond ceiling, or only just (its own p99 is in the Reference column: 106 ms in the run of a852feb, 99.7 ms in that " +
			"of 364428f). By Little's law 1,024 closed-loop writers wait 1,024 / X seconds on average at X appends/s, and the ceiling's own p99 " +
			"is about 2.25 times its mean (99.7 ms at 23,149 requests/s, a mean of 44 ms): with that spread a p99 of 100 ms needs a mean of 44 ms, " +
			"which is the ceiling's throughput itself. PicoMQ's spread in that run was the same: p99 259 ms at a mean of 122 ms (8,422 appends/s). " +
			"Since fb2b514 a compaction takes the entries it compacts at its start (appends made while it runs, with packs to read back " +
			"25 ms away, pushed them out of the cache and it read them back one GET each) and reads those already lost back a GET per WAL " +
			"object: on the rig (this row's load, 40 s, alternated with 2e437bb) 99-110 GETs against 430-824 at the default cache and " +
			"appends/s inside the spread (9.0k and 8.4k against 9.6k and 8.5k); at cache_size 8MiB 7.5k and 8.5k appends/s against 6.3k and " +
			"6.7k, with 1.5-1.7k GETs against 11-12k. What the CPU goes to (the rig, 2026-12-04, each process's CPU over the window divided " +
			"by its appends): the ceiling's Caddy takes about 40 us a request and the load generator about 45, the load generator the same " +
			"against PicoMQ; PicoMQ's Caddy took about 88 us an append, versitygw and the proxy about 12 each. Of Caddy's extra, net/http " +
			"itself starts a goroutine to read ahead on every request whose body is read to its end (an extra read that finds nothing, " +
			"about 4% of Caddy's CPU), which the respond ceiling, reading no body, never does; compaction takes 6-9%, the WAL's uploads " +
			"4%. From c446833 to c25ccaa a pack is laid out in one buffer (its index appended past capacity copied up to 4 MiB), every " +
			"append's timeout shares one timer instead of arming its own, and responses allocate less. On the rig, each step alternated " +
			"with the build before it (3 pairs, fresh Caddy and bucket each, means of Caddy's CPU per append): 88.8 to 86.4 us (pack " +
			"buffer, cache keys, headers), 87.5 to 84.0 (the timer), 82.9 to 81.6 (change channels, offset strings)",
		Tried: "cache_size 256MiB, so compaction runs a quarter as often (PUTs in the run 3,257 against 8,750, but Caddy's CPU up 2.2 s with a heap of " +
			"cached records four times larger, RSS 727 MiB, and appends/s unchanged: 7,736 against 7,670); as an experiment only, no checkpoint PUTs at " +
			"all, which is not durable (PUTs down 30-40%, versitygw and the proxy 5% of a core less, appends/s inside the spread: 7,997 and 7,385 " +
			"against 7,675 and 5,995). So sharing data objects among streams or batching checkpoints would lower the bucket's bill, not lift this " +
			"ratio: the cores go to 1,024 connections' HTTP (Caddy 91% of a core, the load generator 47%). On 2026-12-06 (the rig, this " +
			"row's load, 10,669 appends/s, Caddy 97% of a core, the four processes 1.9 cores), Caddy's CPU profile: the handler 14% (the " +
			"engine's append 6%, reading the body 3%, headers 2%), the socket reads and writes 24%, net/http's read-ahead goroutine 6%, " +
			"compaction 6%, the WAL's uploads 5%, allocation and the garbage collector about 13%; of about 90 allocations per append " +
			"Caddy's own request handling (its replacer, logger, context values, header clones) makes most, PicoMQ's handler and engine " +
			"10 to 15: no part of PicoMQ's own code is worth more than a few percent of this row"},
	"4": {Directives: rowOneTuning, Why: "Row 1's tuning"},
	"5": {Why: "Appends of 256 KiB and more are written once, as blobs the WAL entry names; each byte still crosses two more " +
		"sockets than in the reference",
		Note: "Appends of 256 KiB and more are written once, as blobs the WAL entry names, and compaction lists them instead of copying them. " +
			"The reference PUTs new keys, as the stream keeps every byte, and deletes them after; both halves start with nothing left to write back " +
			"(rewriting a few keys, as the reference did before, let a disk file system drop each object unwritten: 242 MiB/s against about 190). " +
			"Each appended byte still crosses two more sockets than in the reference (client to Caddy, Caddy to the S3 proxy)"},
	"6": {Why: "Each append is 5,000 events that Caddy writes and the load generator reads over loopback on the same 2 cores, a " +
		"system call on each side per event: a wave over every subscriber takes much of the 50 ms between appends, and the p99 is " +
		"where the slowest waves end (82 to 155 ms over the last runs, with the machine as much as with the code)",
		Note: "Each append is 5,000 events (100,000 a second) that Caddy writes and the load generator reads on the same 2 cores, " +
			"each a small TCP segment over loopback whose kernel work (about 5 us in the writer's syscall and 4 us in the reader's) is most of the " +
			"cost. Feeds at the tail park in the stream's hub: one goroutine per processor writes the event, encoded once, to every feed, so an " +
			"append wakes a few goroutines instead of 5,000. A pass goes 256 feeds at a time and reads the stream again before each slice, so a " +
			"record that lands mid-pass joins the previous one in the same write to the feeds not yet written, and reaches the others in a pass " +
			"over just them (since 1d39d50; two runs back to back on this box: p50 54 and p99 122 ms against 78 and 156 before). Since 74202b1 " +
			"the hub writes beneath the idle write timeout Caddy wraps every response in, which moved the connection's deadline before each " +
			"write and each flush (13% of Caddy's CPU in perf) while the hub's own deadline bounds the write anyway: at 5 appends/s, alternated, " +
			"9.4-9.8 s of Caddy's CPU against 10.7-11.1 s for the same 500,000 events. The line at 1 append/s in the details is the floor on this VM: one wave over every " +
			"feed, with the machine to itself, already takes about a hundred milliseconds. The Steal column matters most here: on 2026-12-02 the " +
			"same binary measured p99 105 and 112 ms in two rounds at 19:12 UTC, and 210 to 1,380 ms between 19:25 and 19:50 with 30 to 57% of the CPU " +
			"stolen (/proc/stat's steal counter, read around each run); on 2026-12-03 the full matrix's rounds gave 142, 121 and 105 ms with " +
			"6% stolen, and the row alone, minutes later with 14-17% stolen, 152-336 ms (and 282-483 ms for the build before 9a7efac, whose " +
			"change does not touch this path). The box has no room to spare here: on the rig at 1 append/s a wave costs Caddy 82-110 ms of " +
			"CPU (a write syscall of about 9 us per feed against 5 at 20 appends/s, as each wakes an idle reader) and the load generator " +
			"about 40 ms more than its baseline (measured 2026-12-03 at 0.1 append/s: Caddy 0.24 s and the load generator 1.68 s in 20 s, " +
			"its pollers' 1 ms ticks costing about 8% of a core, most of it (perf) the Go runtime breaking its network poller's sleep, a write " +
			"to its eventfd, for each new timer), so a wave lasts what both need of the two cores, and any CPU taken from them lengthens it. Since 4d129f3 a pass's " +
			"writes run on goroutines the hub watches every 10 ms, so that a client that stopped reading (its socket full) leaves the hub " +
			"instead of holding every other feed up to the write timeout (through Caddy, 20 readers beside one such client: a record 7.4-8.2 s " +
			"late before, 155-560 ms after on a busy box); this row, alternated on 2026-12-04 with the build before (bench/run -rows 6, same " +
			"hour, no steal): rounds 112, 92.5 and 111 ms against 127, 118 and 104, Caddy's CPU 29.8 s against 29.4. Row 6-node is the " +
			"same load on the Node reference server, in memory",
		Tried: "before the hub, a fan-out gate of 1, 2, 8, 16 or 64 x GOMAXPROCS feeds (p99 229-266 ms in all runs), or no gate at all " +
			"(p50 52-59 ms against 135, p99 242-334 against 266-276); waking feeds with the stream's state in the wake-up itself, so that " +
			"5,000 of them do not queue on the stream's mutex (no change); Caddy with GOMAXPROCS=1 (p99 137 ms against 245, a third less " +
			"CPU per event: the cost was the wake-ups, which led to the hub, but one core for everything else). Caddy's own idle write " +
			"timeout resets the connection's deadline at every write (about a tenth of Caddy's CPU here); a handler cannot skip it without " +
			"skipping Caddy's other response wrappers too. Responses without chunked encoding (Transfer-Encoding: identity): 7% fewer " +
			"writes, the same CPU, p99 240-253 ms against 266-297; not worth a new connection, over TLS a new handshake, at every reconnect. " +
			"In the load generator, an epoll poller instead of a goroutine per feed (landed: its CPU 57-74% of a core against 76-80%, its " +
			"RSS 115 MiB against 315; it polls each millisecond, so Caddy's writes need not wake it). With the sliced passes, on the rig " +
			"(20 s windows, the same hour): one writing goroutine per hub instead of one per processor, so that the load generator keeps a " +
			"core (p99 118-125 ms against 87-90), and slices of 64 feeds instead of 256 (p99 115 ms); the rig's spread for the landed " +
			"code was 87-124 ms" +
			"; later (the same hour, alternated): the writing goroutines taking feeds 16 at a time from a shared counter instead of a " +
			"fixed half each, so that one descheduled by the load generator's reads does not leave the other idle at the end of a " +
			"slice (p99 95.6, 101 and 132 ms against 96.3, 106 and 129), and Caddy's write idle timeout off (p99 89.8 and 91.8 " +
			"against 108 and 91.3; its deadline resets are about a tenth of Caddy's CPU but not what sets the p99). At 2e437bb " +
			"(2026-12-02, the rig, alternated): the hub writing beneath Caddy's write idle timeout, whose two deadline resets per event " +
			"its own write deadline makes redundant (Caddy's CPU 3% lower, p99 116, 172 and 106 ms against 117, 115 and 118); perf at " +
			"1 append/s put 56% of Caddy's samples in the write syscall, a third of that in the loopback delivery to the reader. " +
			"Later the same day, at 1 append/s: the load generator with GOMAXPROCS=1, whose scheduler spins less between its polls (its " +
			"CPU 1.84 and 1.93 s against 2.29 and 2.20 s per 20 waves, p99 136 and 128 ms against 113 and 120). On 2026-12-03 (the rig, " +
			"alternated, 15 s at 20 appends/s): the writers taking whole slices from a shared counter, each reading the stream for its own, " +
			"with no wait between slices: better while 7-27% of the CPU was stolen (p99 202, 212 and 173 ms against 253, 240 and 289), " +
			"the same with nothing stolen (82, 90 and 111 ms against 81, 94 and 89) at 10% more of Caddy's CPU, as slices read at " +
			"different moments leave the feeds at more positions, each a pass of its own. The load generator's pollers napping in a " +
			"nanosleep on their own threads instead of time.Sleep, which sets a runtime timer and wakes the network poller every tick: " +
			"its CPU with the feeds quiet about a tenth lower in perf (8.8% of a core against 9.8%), 1.53 and 1.60 s against 1.56 and " +
			"1.49 s per 20 s by /proc; not landed. Later that day (alternated, 15 s at 20 appends/s, 0-2% stolen): unchunked " +
			"responses again, p99 101, 103 and 117 ms against 99, 101 and 103, Caddy's CPU about 1.5% lower; and the hub writing to the " +
			"hijacked connection itself, one writev of chunk header, frame and CRLF instead of net/http's response writer: Caddy's CPU " +
			"13.6 s against 14.2, the load generator's 12.9 s against 11.0, p99 108 against 123 ms; a hijacked response would also " +
			"leave Caddy's access log and graceful shutdown behind; not landed"},
	// Compaction must move the stream into data objects before the cold
	// read, so it runs often here.
	"7": {Directives: []string{"compact_interval 2s"},
		Why: "Each byte takes one more hop than in the reference (versitygw to Caddy to the reader), on the same two cores; the " +
			"reference's own speed differs from run to run, and the ratio with it",
		Note: "Caddy reads straight from versitygw, as the reference does (until 2026-12-01 it read through the S3 proxy, which copies " +
			"every byte once more on the same two cores: the same read through it is in the details, with its S3 requests). Each byte " +
			"still takes one more hop than in the reference (versitygw to Caddy to the client, against versitygw to the client), and the " +
			"three processes share two cores. What set this read apart was that it is a freshly started process's first: every fresh " +
			"page is a fault (the Machine table has the cost), and a buffer per object grew Caddy's heap by about 60 MiB during the read, " +
			"some 15,000 faults, a quarter of its CPU (row 7-warm, the same Caddy's second read, is the comparison). Since 4f2506a cold " +
			"objects are read into recycled buffers that come back once the response is written, and since 5194b5c a reader's " +
			"read-ahead grows only when it has to wait for an object, so next to versitygw it keeps two or so in flight, not 16 MiB: " +
			"5,000-7,000 faults and 0.6-0.7 s of Caddy's CPU per read (0.9-1.3 s before). The rest is the kernel's socket copies (half " +
			"of Caddy's samples) and the CRC-32C of every byte read (a tenth). Both readers, the reference's and the load generator's, " +
			"read their bodies 256 KiB at a time since 2026-12-02; before, io.Copy to io.Discard read 8 KiB at a time, and that held the " +
			"reference back more than PicoMQ, whose Caddy is what bounds it (on the rig, alternated: the reference 796 and 826 MiB/s " +
			"against 522 and 649, PicoMQ 467 and 414 against 341 and 439, so 59 and 50% against 65 and 68%). Since 9a7efac a Durable " +
			"Streams response carries up to 4 MiB instead of 1 MiB: the reader waits a round trip between responses, in which nothing " +
			"flows, and paid one per 1 MiB record (on the rig, 2026-12-03, fresh Caddy, alternated with the 1 MiB build: faster in 10 of " +
			"12 pairs, the two others with a fifth of the CPU stolen; e.g. 643 and 659 MiB/s against 546 and 496, Caddy's CPU 0.38-0.41 s " +
			"per read against 0.42-0.48). During the read Caddy runs at 93-99% of one core, versitygw at about 40% and the reader at 30%. " +
			"The reference is what moves this row: on 2026-12-05, four runs of bench/run -rows 7 alternating the day's first and last " +
			"builds (79188b0, 4a0f0a1), PicoMQ read at 608-703 MiB/s in every round, while the reference stayed, run by run, near " +
			"820-1,073 MiB/s (ratios 61-81%) or near 1,104-1,494 (45-60%), with either build: the row's result follows which of the two " +
			"its run gets, and nothing in the matrix chooses that",
		Tried: "responses of 4 or 8 MiB instead of 1 MiB, first when the read went through the proxy at about 200 MiB/s (215-218 " +
			"against 199-215 MiB/s, not landed then; at today's speed the round trips matter, see the note; 8 MiB gains nothing over 4); checksumming each 64 KiB of a data object as it " +
			"arrives, while it is in the CPU cache, instead of the whole object afterwards (270-310 against 280-293 MiB/s: the 16% the profile " +
			"put in the checksum was the first touch of memory the socket had just filled, which moved rather than went). Outside the matrix's " +
			"layout, Caddy reading straight from versitygw without the proxy: 280-313 MiB/s against 210-213 through it on the rig, still under " +
			"70% of the reference's 460-613. Later, on the rig and straight from versitygw: 4 read-ahead GETs at a time instead of 2 (233 MiB/s, " +
			"no change); a read-ahead of 8 or 4 MiB instead of 16 (page faults per read down from about 14,500 to 11,000 and 8,800, MiB/s the same " +
			"within the spread); faults all but gone (a build that touched 64 MiB of heap at start, run with GODEBUG=madvdontneed=0 so the " +
			"runtime kept those pages: 150 faults against 14,500, 274-291 against 255-271 MiB/s). What sets the measured read apart is that it " +
			"is the process's first: in one Caddy, a second cold 256 MiB stream read after the first went at 308-310 MiB/s against 234-241 " +
			"(Caddy's CPU 0.70 s against 1.07-1.16 s), and perf put the first read's extra time in the kernel's socket copies and in the " +
			"checksum over the same bytes (3 and 6 times the samples of the later read), which is how first use of memory costs on this VM. " +
			"On 2026-12-02, with a fault costing 2.3 us that evening: pooled buffers of 2 MiB and more advised to transparent huge pages " +
			"(madvise, the machine's THP mode), three row 7 runs alternated with the build without: 64.2, 62.9 and 66.2% against 64.3, 67.3 " +
			"and 64.3%, no gain, not landed. On 2026-12-03 (the rig, fresh Caddy): perf put 25% of Caddy's samples in the socket writes " +
			"to the reader, 22% in the socket reads from versitygw, 15% in the S3 SDK's handling of each GET (about 280 us per GET: " +
			"middleware, endpoint resolution, signing) and 6.5% in the CRC. GETs signed with the SDK's own v4 signer and sent on the same " +
			"HTTP client, skipping its middleware: Caddy's CPU per read 9-10% lower (lower in 21 of 22 alternated pairs), MiB/s +3.5%, " +
			"inside the spread; not landed, as a second S3 client to keep correct for every store and endpoint form is a poor trade for that. On 2026-12-04 (the rig, fresh Caddy, perf): 11% of Caddy's samples in the " +
			"CRC-32C (about 6 GB/s over bytes the socket copy had just written), 17% in that copy and 7.5% in the page faults it takes. The " +
			"faults (6,400-7,600 per read) are the heap growing by the cold cache's 24 MiB, not buffers failing to come back: a build that " +
			"dropped each cold object from the cache once the reader moved past it still took 7,596, and one that capped cold objects at " +
			"6 MiB evicted the read-ahead's objects before they were read (189-280 MiB/s)"},
	"7-warm": {Directives: []string{"compact_interval 2s"},
		Why: "Not the issue's row: the same Caddy's second read, to show what a fresh process's first read pays",
		Note: "The process of row 7's timed read, right after it: its heap has grown and its connections to versitygw are open. " +
			"Cold objects leave its cache as the reader moves past them, so the objects come from versitygw again (the same second read through " +
			"the S3 proxy, in the details, counts the GETs). Not the issue's row: a freshly started Caddy is what row 7 asks for; this " +
			"row shows what that first read pays on this machine"},
	"7-cloud": {Directives: []string{"compact_interval 2s"}, Latency: 25 * time.Millisecond,
		Why: "The read-ahead keeps up to 16 MiB of objects in flight; the reference reads one range at a time, each GET waiting the whole delay",
		Note: "The read-ahead keeps the next 16 MiB of objects in flight (16 GETs at most), and the window slides with the reader: what a " +
			"read must keep in flight is bandwidth times latency. Before 8e18c36 it fetched two at a time, window by window, and read this " +
			"stream at about 64 MiB/s on the rig. The reference reads one range at a time, so each of its GETs waits the whole delay; it is " +
			"what a plain sequential reader gets from such a bucket, not a ceiling." +
			" Since 8b416bf the window opens at two objects, so one read at an old offset does not fetch sixteen, and since 5194b5c it " +
			"doubles only when the reader moves on and finds its next object not there yet, which from this bucket is every object " +
			"until the window covers the delay"},
	"8": {Why: "Streams leave memory once a compaction has folded them, and a sweep that finds 1,000 idle streams waiting for one starts it",
		Note: "Until 680a773 this row landed anywhere from +18.5 to +109 MiB for the same code: the streams leave memory only " +
			"once a compaction has folded them, which the 30 s interval put anywhere from 30 to 60 s after they went idle, and the " +
			"fold of the last of them (24 s on this box) could still be running, its heap held, when the minute ended. Since " +
			"680a773 a sweep that finds 1,000 idle streams waiting for a fold starts one, and the compaction lets them go as it " +
			"ends; the RSS line in the details shows memory back within 35 s of the last request (rerun alone twice on 2026-12-02: " +
			"+19.3 and +19.3 MiB)"},
	// "At row 1's load": row 1's settings too.
	"9":     {Directives: rowOneTuning, Why: "Row 1's settings and load"},
	"sweep": {Directives: rowOneTuning},
}

func (s settings) String() string {
	var parts []string
	if len(s.Directives) == 0 {
		parts = append(parts, "defaults")
	} else {
		for _, d := range s.Directives {
			parts = append(parts, "`"+d+"`")
		}
	}
	switch {
	case s.Latency > 0 && s.Jitter > 0:
		parts = append(parts, fmt.Sprintf("S3 +%s (+0–%s jitter)", s.Latency, s.Jitter))
	case s.Latency > 0:
		parts = append(parts, fmt.Sprintf("S3 +%s per request", s.Latency))
	case s.Jitter > 0:
		parts = append(parts, fmt.Sprintf("S3 +0–%s jitter", s.Jitter))
	}
	return strings.Join(parts, ", ")
}

func sweepSettings() string { return rowSettings["sweep"].String() }

// scale holds the window lengths and sizes of a run.
type scale struct {
	Warmup, Duration         time.Duration // rows 1, 3, 4, 5 and Node
	CostWarmup, CostDuration time.Duration // row 2
	ManyStreams              int           // row 2-many: streams sharing ManyRate appends/s
	ManyRate                 float64
	ManyWarmup, ManyDuration time.Duration // row 2-many
	SSESubscribers           int
	SSERate                  float64
	SSEDuration              time.Duration
	CatchupMiB               int // row 7
	IdleStreams              int // row 8
	IdleWorkers              int // row 8: concurrent creates (populate) and reads (verify)
	IdleWait                 time.Duration
	CrashLoad, CrashAfter    time.Duration // row 9: load length, SIGKILL after
	SweepWriters             []int
	SweepWarmup              time.Duration
	SweepDuration            time.Duration
	// Rounds is how many times rows 1, 3 and 4 measure their ceiling and
	// PicoMQ, alternately (row 7, whose rounds last seconds, takes
	// 2*Rounds+1); the ratio is the median round's. Row 6 runs as many
	// rounds and counts the median round's p99. On a shared
	// 2-core VM one window can be off by a fifth either way.
	Rounds int
}

// fullScale is the matrix.
var fullScale = scale{
	Warmup: 5 * time.Second, Duration: 20 * time.Second,
	CostWarmup: 10 * time.Second, CostDuration: 60 * time.Second,
	ManyStreams: 10_000, ManyRate: 2000,
	// Streams leave the packs 5 to 10 minutes after they came in, each
	// with a data PUT and a checkpoint: a window that ended before would
	// count none of that. Seven minutes in, the first streams are leaving.
	ManyWarmup: 7 * time.Minute, ManyDuration: 3 * time.Minute,
	SSESubscribers: 5000, SSERate: 20, SSEDuration: 30 * time.Second,
	CatchupMiB: 256,
	// 256 workers, not 64: creating and reading back 100,000 streams is
	// the row's set-up, not its measure (memory after the idle minute),
	// and at 64 workers it took 16 of the matrix's 28 minutes.
	IdleStreams: 100_000, IdleWorkers: 256, IdleWait: 60 * time.Second,
	CrashLoad: 15 * time.Second, CrashAfter: 5 * time.Second,
	SweepWriters: []int{1, 4, 16, 64, 256, 1024},
	SweepWarmup:  2 * time.Second, SweepDuration: 6 * time.Second,
	Rounds: 3,
}

// quickScale is a smoke run of every code path in a few minutes.
var quickScale = scale{
	Warmup: time.Second, Duration: 3 * time.Second,
	CostWarmup: 2 * time.Second, CostDuration: 5 * time.Second,
	ManyStreams: 1000, ManyRate: 500,
	ManyWarmup: 2 * time.Second, ManyDuration: 5 * time.Second,
	SSESubscribers: 200, SSERate: 20, SSEDuration: 5 * time.Second,
	CatchupMiB:  16,
	IdleStreams: 2000, IdleWorkers: 256, IdleWait: 5 * time.Second,
	CrashLoad: 6 * time.Second, CrashAfter: 2 * time.Second,
	SweepWriters: []int{1, 16, 256},
	SweepWarmup:  500 * time.Millisecond, SweepDuration: 2 * time.Second,
	Rounds: 1,
}

// rowDefs are the rows in the order they run; key is what -rows takes.
var rowDefs = []struct {
	key, title string
	run        func(*matrix, context.Context)
}{
	{"1", "appends, 64 writers over 100 streams: tuned, defaults, Node reference", (*matrix).row1},
	{"2", "object-store cost, 256 writers over 100 streams; and 10,000 slow streams", (*matrix).row2AndMany},
	{"3", "cloud-like S3 (+25 ms), 1,024 writers over 1,000 streams", (*matrix).row3},
	{"4", "one hot stream, 64 writers", (*matrix).row4},
	{"5", "1 MiB appends, 8 writers", (*matrix).row5},
	{"6", "fan-out to SSE subscribers, and on the Node reference server", (*matrix).row6},
	{"7", "cold catch-up read", (*matrix).row7},
	{"8", "idle streams cost no memory", (*matrix).row8},
	{"9", "recovery after SIGKILL", (*matrix).row9},
	{"sweep", "writer sweep for the chart", (*matrix).rowSweep},
}

// picoEnv is one PicoMQ Caddy on a fresh bucket behind a fresh S3 proxy.
type picoEnv struct {
	m      *matrix
	id     string
	bucket string
	proxy  *testenv.Proxy
	caddy  *caddyInst
	set    settings
}

func (m *matrix) newPico(ctx context.Context, id string, set settings) (*picoEnv, error) {
	m.buckets++
	bucket := fmt.Sprintf("bench-%s-%d", strings.ToLower(strings.NewReplacer("_", "-", " ", "-").Replace(id)), m.buckets)
	if err := m.versity.CreateBucket(ctx, bucket); err != nil {
		return nil, err
	}
	p, err := testenv.NewProxy(m.versity.Endpoint)
	if err != nil {
		return nil, err
	}
	p.SetLatency(set.Latency, set.Jitter)
	m.ctrl.use(p)
	storage := testenv.StoreURL(p.URL(), bucket, caddytest.S3Prefix)
	c, err := m.newCaddy(ctx, id, func(port int) string { return caddyPicoMQ(port, storage, set.Directives) }, caddytest.S3Env(m.versity))
	if err != nil {
		m.ctrl.use(nil)
		p.Close()
		return nil, err
	}
	m.logf("  picomq caddy %s: pid %d on %s, bucket %s, settings: %s", id, c.pid(), c.url(), bucket, set)
	return &picoEnv{m: m, id: id, bucket: bucket, proxy: p, caddy: c, set: set}, nil
}

func (e *picoEnv) close() {
	e.caddy.close()
	e.m.ctrl.use(nil)
	e.proxy.Close()
	// Nothing reads a row's bucket after its row, and on a tmpfs the
	// buckets of a whole run would otherwise stay in memory.
	if err := os.RemoveAll(filepath.Join(e.m.versityDir, e.bucket)); err != nil {
		e.m.logf("  removing bucket %s: %v", e.bucket, err)
	}
}

// ceilingInst starts the respond ceiling on first use; it runs until the
// matrix ends.
func (m *matrix) ceilingInst(ctx context.Context) (*caddyInst, error) {
	if m.ceiling != nil && m.ceiling.p.running() {
		return m.ceiling, nil
	}
	c, err := m.newCaddy(ctx, "ceiling", caddyRespond, nil)
	if err != nil {
		return nil, err
	}
	m.logf("  ceiling caddy (respond 204): pid %d on %s", c.pid(), c.url())
	m.ceiling = c
	return c, nil
}

// measureCeiling runs spec against the respond ceiling.
func (m *matrix) measureCeiling(ctx context.Context, name string, spec benchSpec) (*benchResult, string, error) {
	c, err := m.ceilingInst(ctx)
	if err != nil {
		return nil, "", err
	}
	spec.URL = c.url()
	spec.Pids = map[string]int{"caddy": c.pid()}
	spec.Mark = ""
	r, cl, err := m.runBench(ctx, name, spec)
	if err == nil {
		m.logf("  ceiling: %s", benchSummary(r))
	}
	return r, cl, err
}

// picoRun is a load-generator run against a PicoMQ instance with the S3
// requests of its measured window.
type picoRun struct {
	res    *benchResult
	s3     s3Window
	marked bool // s3 covers exactly the marked window (else the whole run)
	cmd    string
}

func (pr *picoRun) per1k() float64 {
	if pr.res == nil || pr.res.Ops <= 0 {
		return math.NaN()
	}
	return float64(pr.s3.Total) * 1000 / float64(pr.res.Ops)
}

// measurePico runs spec against e with the proxy's marks.
func (m *matrix) measurePico(ctx context.Context, e *picoEnv, name string, spec benchSpec) (*picoRun, error) {
	spec.URL = e.caddy.url()
	// versitygw and this process (the S3 proxy runs in it) share the
	// cores with Caddy; their CPU time shows where the box's time goes.
	spec.Pids = map[string]int{"caddy": e.caddy.pid(), "versitygw": m.versity.PID(), "proxy": os.Getpid()}
	spec.Mark = m.ctrl.markURL()
	m.ctrl.use(e.proxy)
	before := e.proxy.Counts()
	t0 := time.Now()
	r, cl, err := m.runBench(ctx, name, spec)
	pr := &picoRun{res: r, cmd: cl}
	if err != nil {
		return pr, err
	}
	if w, ok := m.ctrl.window(); ok {
		pr.s3, pr.marked = w, true
	} else {
		pr.s3 = diffCounts(before, e.proxy.Counts(), time.Since(t0))
	}
	m.logf("  picomq: %s, %s S3 requests/1,000 ops", benchSummary(r), fmtNum(pr.per1k()))
	return pr, nil
}

// appendSpec is an append load.
func appendSpec(prefix string, writers, streams, size int, warmup, dur time.Duration) benchSpec {
	return benchSpec{Mode: "append", Prefix: prefix, Writers: writers, Streams: streams, Size: size, Warmup: warmup, Duration: dur}
}

// appendMeasured describes an append run for the Measured column.
func appendMeasured(pr *picoRun) string {
	r := pr.res
	s := fmt.Sprintf("%s appends/s, p99 %s ms", fmtInt(float64(r.OpsPerS)), fmtNum(float64(r.Latency.P99)))
	if pr.s3.Total > 0 {
		s += fmt.Sprintf(", %s S3 req/1,000 appends", fmtNum(pr.per1k()))
	}
	if r.Errors > 0 {
		s += fmt.Sprintf(", %s errors", fmtInt(float64(r.Errors)))
	}
	return s
}

func ceilingRef(r *benchResult) string {
	return fmt.Sprintf("respond 204: %s requests/s, p99 %s ms", fmtInt(float64(r.OpsPerS)), fmtNum(float64(r.Latency.P99)))
}

func s3Breakdown(w s3Window, marked bool) string {
	s := fmt.Sprintf("S3 requests in the window: %d (PUT %d, GET %d, LIST %d, DELETE %d, HEAD %d, other %d), %s uploaded",
		w.Total, w.Put, w.Get, w.List, w.Delete, w.Head, w.Other, fmtBytes(w.BytesPut))
	if !marked {
		s += "; the load generator did not mark its window, so these cover the whole run including warm-up and stream creation"
	}
	return s
}

func fmtBytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

func errorCheck(r *benchResult) check {
	return check{What: "errors", Got: float64(r.Errors), Limit: 0}
}

func errorDetail(r *benchResult) []string {
	if r.Errors == 0 || len(r.ErrorSamples) == 0 {
		return nil
	}
	n := min(len(r.ErrorSamples), 3)
	return []string{fmt.Sprintf("error samples: %s", strings.Join(r.ErrorSamples[:n], "; "))}
}

func processDetail(r *benchResult) []string {
	var out []string
	for _, p := range r.Processes {
		out = append(out, fmt.Sprintf("%s (pid %d) over the window: %.1f s CPU, RSS %.0f MiB, peak %.0f MiB, %s minor page faults",
			p.Name, int(p.PID), float64(p.CPUS), float64(p.RSSMiB), float64(p.PeakRSSMiB), fmtInt(float64(p.Faults))))
	}
	return out
}

// throughputRows measures the ceiling for spec and then PicoMQ with each
// id's settings (a fresh instance each time), as rows with the same
// targets; it does so m.sc.Rounds times, alternately, and judges each row
// by its median round (ratio and p99). It returns the median round's
// ceiling.
func (m *matrix) throughputRows(ctx context.Context, ids []string, titles []string, target string, spec benchSpec, minRatio, maxP99 float64) *benchResult {
	rounds := max(m.sc.Rounds, 1)
	rows := make([]*rowResult, len(ids))
	runs := make([][]*picoRun, len(ids))
	took := make([]time.Duration, len(ids))
	for i, id := range ids {
		r := newRow(id, titles[i], target)
		set := rowSettings[id]
		r.use(set)
		m.rows = append(m.rows, r)
		rows[i] = r
	}
	var ceils []*benchResult
	var ceilTook time.Duration
	for round := 1; round <= rounds; round++ {
		t1 := time.Now()
		ceil, ceilCmd, err := m.measureCeiling(ctx, fmt.Sprintf("r%s-ceiling-%d", ids[0], round), spec)
		ceilTook += time.Since(t1)
		for _, r := range rows {
			if round == 1 {
				r.Commands = append(r.Commands, "# reference: the respond ceiling", ceilCmd)
			}
			if err != nil && r.Err == "" {
				r.Err = "ceiling: " + err.Error()
			}
		}
		if err != nil {
			break
		}
		ceils = append(ceils, ceil)
		for i, id := range ids {
			r := rows[i]
			if r.Err != "" {
				continue
			}
			// A fresh instance every round: one left running would
			// compact in the background through the next ceiling.
			t2 := time.Now()
			e, err := m.newPico(ctx, id, rowSettings[id])
			if err != nil {
				r.Err = "starting PicoMQ: " + err.Error()
				continue
			}
			pr, err := m.measurePico(ctx, e, fmt.Sprintf("r%s-%d", id, round), spec)
			e.close()
			took[i] += time.Since(t2)
			if round == 1 {
				r.Commands = append(r.Commands, "# PicoMQ", pr.cmd)
			}
			if err != nil {
				r.Err = err.Error()
				continue
			}
			runs[i] = append(runs[i], pr)
		}
	}
	if rounds > 1 {
		for _, r := range rows {
			r.Commands = append(r.Commands, fmt.Sprintf("# both commands %d times, alternately (ceiling, PicoMQ, ceiling, ...), PicoMQ on a fresh instance and bucket each time", rounds))
		}
	}
	for i, r := range rows {
		r.Elapsed = took[i] + ceilTook
		if r.Err != "" || len(runs[i]) != len(ceils) || len(ceils) == 0 {
			continue
		}
		judgeRounds(r, ceils, runs[i], minRatio, maxP99)
	}
	if len(ceils) == 0 {
		return nil
	}
	return medianCeiling(ceils)
}

// judgeRounds fills r from paired rounds: the ratio and p99 checked are
// the medians; Measured and the details are the median-ratio round's.
func judgeRounds(r *rowResult, ceils []*benchResult, runs []*picoRun, minRatio, maxP99 float64) {
	ratios := make([]float64, len(runs))
	p99s := make([]float64, len(runs))
	for k, pr := range runs {
		if c := ceils[k].OpsPerS; c > 0 {
			ratios[k] = float64(pr.res.OpsPerS) / float64(c)
		}
		p99s[k] = float64(pr.res.Latency.P99)
	}
	mid := medianIndex(ratios)
	pr, ceil := runs[mid], ceils[mid]
	sortedP99 := append([]float64(nil), p99s...)
	sort.Float64s(sortedP99)
	medP99 := sortedP99[len(sortedP99)/2]

	r.Reference = ceilingRef(ceil)
	r.Measured = appendMeasured(pr)
	r.Ratio = ratios[mid]
	if len(runs) > 1 {
		var parts []string
		for k := range runs {
			parts = append(parts, fmt.Sprintf("%s/%s = %.1f%% (p99 %s ms)", fmtInt(float64(runs[k].res.OpsPerS)),
				fmtInt(float64(ceils[k].OpsPerS)), 100*ratios[k], fmtNum(p99s[k])))
		}
		r.Reference += fmt.Sprintf(" (round %d of %d, the median)", mid+1, len(runs))
		r.Measured += fmt.Sprintf("; median of %d rounds", len(runs))
		r.Details = append(r.Details, "rounds (PicoMQ/ceiling appends/s): "+strings.Join(parts, "; "))
	}
	r.Checks = append(r.Checks, ratioCheck(r.Ratio, minRatio))
	if maxP99 > 0 {
		r.Checks = append(r.Checks, check{What: "p99 (median of the rounds)", Got: medP99, Limit: maxP99, Unit: "ms"})
	}
	r.Checks = append(r.Checks, errorCheck(pr.res))
	r.Details = append(r.Details, s3Breakdown(pr.s3, pr.marked))
	r.Details = append(r.Details, fmt.Sprintf("PicoMQ latency ms: p50 %s, p90 %s, p99 %s, p99.9 %s, max %s",
		fmtNum(float64(pr.res.Latency.P50)), fmtNum(float64(pr.res.Latency.P90)), fmtNum(float64(pr.res.Latency.P99)),
		fmtNum(float64(pr.res.Latency.P999)), fmtNum(float64(pr.res.Latency.Max))))
	r.Details = append(r.Details, processDetail(pr.res)...)
	r.Details = append(r.Details, errorDetail(pr.res)...)
}

// medianIndex returns the index of the median of values (the upper one of
// an even count).
func medianIndex(values []float64) int {
	order := make([]int, len(values))
	for k := range order {
		order[k] = k
	}
	sort.Slice(order, func(a, b int) bool { return values[order[a]] < values[order[b]] })
	return order[len(order)/2]
}

// medianCeiling returns the ceiling run with the median throughput.
func medianCeiling(ceils []*benchResult) *benchResult {
	c := append([]*benchResult(nil), ceils...)
	sort.Slice(c, func(a, b int) bool { return c[a].OpsPerS < c[b].OpsPerS })
	return c[len(c)/2]
}

// row1: 64 writers over 100 streams, tuned and at the defaults, and the
// Node reference server under the same load.
func (m *matrix) row1(ctx context.Context) {
	spec := appendSpec("/r1/", 64, 100, 1024, m.sc.Warmup, m.sc.Duration)
	m.row1Ceiling = m.throughputRows(ctx, []string{"1", "1-defaults"},
		[]string{"Appends, 64 writers over 100 streams", "Row 1 at the module's defaults"},
		"≥ 50% of the ceiling; p99 ≤ 25 ms", spec, 0.5, 25)

	r, res := m.nodeRow(ctx, "1-node", "1", spec)
	if res == nil {
		return
	}
	r.Measured = fmt.Sprintf("%s appends/s, p99 %s ms", fmtInt(float64(res.OpsPerS)), fmtNum(float64(res.Latency.P99)))
	if res.Errors > 0 {
		r.Measured += fmt.Sprintf(", %s errors", fmtInt(float64(res.Errors)))
	}
	if c := m.row1Ceiling; c != nil && c.OpsPerS > 0 {
		r.Reference = ceilingRef(c) + " (row 1's)"
		r.Ratio = float64(res.OpsPerS) / float64(c.OpsPerS)
	}
}

// nodeRow runs spec against a fresh Node reference server (in memory) as
// row id, the comparison for row of. It returns the row and the result,
// which is nil when the run failed (the row's Err says why).
func (m *matrix) nodeRow(ctx context.Context, id, of string, spec benchSpec) (*rowResult, *benchResult) {
	t0 := time.Now()
	r := newRow(id, "Row "+of+"'s load on the Node reference server (`@durable-streams/server`, in memory, not durable)", "none: a comparison")
	r.Settings = "in memory, `compression: false`"
	m.rows = append(m.rows, r)
	defer func() { r.Elapsed = time.Since(t0) }()
	p, url, err := m.nodeServer(ctx)
	if err != nil {
		r.Err = "starting the Node server: " + err.Error()
		return r, nil
	}
	defer p.stop(5 * time.Second)
	m.logf("  node server: pid %d on %s", p.pid(), url)
	spec.URL = url
	spec.Pids = map[string]int{"node": p.pid()}
	res, cl, err := m.runBench(ctx, "r"+id, spec)
	r.Commands = append(r.Commands, cl)
	if err != nil {
		r.Err = err.Error()
		return r, nil
	}
	m.logf("  node: %s", benchSummary(res))
	r.Details = append(r.Details, processDetail(res)...)
	r.Details = append(r.Details, errorDetail(res)...)
	return r, res
}

// row2AndMany runs row 2, then the same cost spread over many streams,
// which it compares with row 2's figure.
func (m *matrix) row2AndMany(ctx context.Context) {
	_, busy, ok := m.costRow(ctx, "2", "Object-store cost, 256 writers over 100 streams",
		"≤ 10 S3 requests of any kind per 1,000 appends", 10, appendSpec("/r2/", 256, 100, 1024, m.sc.CostWarmup, m.sc.CostDuration))
	title := fmt.Sprintf("Object-store cost, %s streams sharing %s appends/s (64 writers)",
		fmtInt(float64(m.sc.ManyStreams)), fmtInt(m.sc.ManyRate))
	spec := appendSpec("/r2m/", 64, m.sc.ManyStreams, 1024, m.sc.ManyWarmup, m.sc.ManyDuration)
	spec.Rate = m.sc.ManyRate
	r, _, _ := m.costRow(ctx, "2-many", title, "none: a comparison", 0, spec)
	r.Reference = "row 2 (100 busy streams): see its row"
	if ok {
		r.Reference = fmt.Sprintf("row 2 (100 busy streams): %s S3 req/1,000 appends", fmtNum(busy.per1k()))
	}
}

// costRow measures S3 requests per 1,000 appends of spec on a fresh
// instance with row id's settings, and checks it against limit; with
// limit 0 the row is a comparison, which has no target to miss, but
// errors void its figure. It reports whether the figure was measured.
func (m *matrix) costRow(ctx context.Context, id, title, target string, limit float64, spec benchSpec) (*rowResult, *picoRun, bool) {
	t0 := time.Now()
	r := newRow(id, title, target)
	set := rowSettings[id]
	r.use(set)
	m.rows = append(m.rows, r)
	defer func() { r.Elapsed = time.Since(t0) }()
	e, err := m.newPico(ctx, id, set)
	if err != nil {
		r.Err = "starting PicoMQ: " + err.Error()
		return r, nil, false
	}
	defer e.close()
	pr, err := m.measurePico(ctx, e, "r"+id, spec)
	r.Commands = append(r.Commands, pr.cmd)
	if err != nil {
		r.Err = err.Error()
		return r, nil, false
	}
	r.Measured = fmt.Sprintf("%s S3 req/1,000 appends over %s; %s appends/s, p99 %s ms",
		fmtNum(pr.per1k()), spec.Duration, fmtInt(float64(pr.res.OpsPerS)), fmtNum(float64(pr.res.Latency.P99)))
	switch {
	case limit > 0:
		r.Checks = append(r.Checks, check{What: "S3 requests per 1,000 appends", Got: pr.per1k(), Limit: limit}, errorCheck(pr.res))
	case pr.res.Errors > 0:
		r.Err = fmt.Sprintf("%d appends failed", int64(pr.res.Errors))
	}
	r.Details = append(r.Details, s3Breakdown(pr.s3, pr.marked))
	r.Details = append(r.Details, processDetail(pr.res)...)
	r.Details = append(r.Details, errorDetail(pr.res)...)
	return r, pr, true
}

// row3: a cloud-like store, many writers and streams.
func (m *matrix) row3(ctx context.Context) {
	spec := appendSpec("/r3/", 1024, 1000, 1024, m.sc.Warmup, m.sc.Duration)
	m.throughputRows(ctx, []string{"3"}, []string{"Cloud-like S3 (+25 ms per request), 1,024 writers over 1,000 streams"},
		"≥ 50% of the ceiling with the same 1,024 writers; p99 ≤ 100 ms", spec, 0.5, 100)
}

// row4: one hot stream.
func (m *matrix) row4(ctx context.Context) {
	spec := appendSpec("/r4/", 64, 1, 1024, m.sc.Warmup, m.sc.Duration)
	m.throughputRows(ctx, []string{"4"}, []string{"One hot stream, 64 writers"},
		"≥ 30% of the ceiling", spec, 0.3, 0)
}
