//go:build linux

package main

import (
	"fmt"
	"html"
	"math"
	"strings"
)

// sweepPoint is one writer count of the sweep: PicoMQ and the respond
// ceiling under the same load.
type sweepPoint struct {
	Writers int
	PicoOps float64 // appends/s
	PicoP99 float64 // ms
	CeilOps float64 // requests/s
	CeilP99 float64 // ms
}

func sweepWriters(ps []sweepPoint) []int {
	w := make([]int, len(ps))
	for i, p := range ps {
		w[i] = p.Writers
	}
	return w
}

// Chart geometry: two panels side by side.
const (
	chartW     = 960
	chartH     = 430
	panelW     = 400
	panelH     = 280
	panelTop   = 60
	panelLeft1 = 80
	panelLeft2 = 560
)

// series drawn in each panel.
var chartSeries = []struct {
	name  string
	color string
	ops   func(sweepPoint) float64
	p99   func(sweepPoint) float64
}{
	{"PicoMQ (versitygw via S3 proxy)", "#1f6fb4", func(p sweepPoint) float64 { return p.PicoOps }, func(p sweepPoint) float64 { return p.PicoP99 }},
	{"ceiling: respond 204, same Caddy", "#d9711c", func(p sweepPoint) float64 { return p.CeilOps }, func(p sweepPoint) float64 { return p.CeilP99 }},
}

// chartSVG draws throughput (linear) and p99 (log) against writer count (log
// scale) as a standalone SVG document.
func chartSVG(points []sweepPoint, title string) string {
	var b strings.Builder
	fmt.Fprintf(&b, `<?xml version="1.0" encoding="UTF-8"?>`+"\n")
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="Helvetica, Arial, sans-serif" font-size="12">`+"\n", chartW, chartH, chartW, chartH)
	fmt.Fprintf(&b, `<rect x="0" y="0" width="%d" height="%d" fill="#ffffff"/>`+"\n", chartW, chartH)
	fmt.Fprintf(&b, `<text x="%d" y="24" font-size="16" font-weight="bold" text-anchor="middle">%s</text>`+"\n", chartW/2, esc(title))

	if len(points) == 0 {
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="middle">no data</text>`+"\n", chartW/2, chartH/2)
		b.WriteString("</svg>\n")
		return b.String()
	}

	// x: writers, log2 scale over the sweep's range.
	minW, maxW := math.Inf(1), math.Inf(-1)
	for _, p := range points {
		w := float64(max(p.Writers, 1))
		minW, maxW = math.Min(minW, w), math.Max(maxW, w)
	}
	if maxW == minW {
		maxW = minW * 2
	}
	xpos := func(left float64, w int) float64 {
		f := (math.Log2(float64(max(w, 1))) - math.Log2(minW)) / (math.Log2(maxW) - math.Log2(minW))
		return left + 20 + f*(panelW-40)
	}

	// Left panel: throughput, linear from 0.
	maxOps := 0.0
	for _, p := range points {
		for _, s := range chartSeries {
			maxOps = math.Max(maxOps, s.ops(p))
		}
	}
	opsTop, opsStep := niceScale(maxOps)
	yOps := func(v float64) float64 {
		return panelTop + panelH - v/opsTop*panelH
	}
	panelFrame(&b, panelLeft1, "appends/s (requests/s for the ceiling)")
	for v := 0.0; v <= opsTop+opsStep/2; v += opsStep {
		y := yOps(v)
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e4e4e4"/>`+"\n", panelLeft1, y, panelLeft1+panelW, y)
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end" dominant-baseline="middle">%s</text>`+"\n", panelLeft1-6, y, esc(shortNum(v)))
	}

	// Right panel: p99 in ms, log10 over whole decades.
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, p := range points {
		for _, s := range chartSeries {
			if v := s.p99(p); v > 0 {
				lo, hi = math.Min(lo, v), math.Max(hi, v)
			}
		}
	}
	if math.IsInf(lo, 1) {
		lo, hi = 1, 10
	}
	decLo, decHi := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
	if decHi <= decLo {
		decHi = decLo + 1
	}
	yP99 := func(v float64) float64 {
		if v <= 0 {
			v = math.Pow(10, decLo)
		}
		f := (math.Log10(v) - decLo) / (decHi - decLo)
		return panelTop + panelH - f*panelH
	}
	panelFrame(&b, panelLeft2, "p99 latency, ms (log scale)")
	for d := decLo; d <= decHi; d++ {
		v := math.Pow(10, d)
		y := yP99(v)
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e4e4e4"/>`+"\n", panelLeft2, y, panelLeft2+panelW, y)
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end" dominant-baseline="middle">%s</text>`+"\n", panelLeft2-6, y, esc(shortNum(v)))
	}

	// x ticks on both panels.
	for _, left := range []int{panelLeft1, panelLeft2} {
		for _, p := range points {
			x := xpos(float64(left), p.Writers)
			fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#999999"/>`+"\n", x, panelTop+panelH, x, panelTop+panelH+5)
			fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%d</text>`+"\n", x, panelTop+panelH+18, p.Writers)
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="middle">writers (100 streams, 1 KiB appends)</text>`+"\n", left+panelW/2, panelTop+panelH+38)
	}

	// Lines and points.
	for _, s := range chartSeries {
		var opsPts, p99Pts []string
		for _, p := range points {
			opsPts = append(opsPts, fmt.Sprintf("%.1f,%.1f", xpos(panelLeft1, p.Writers), yOps(s.ops(p))))
			p99Pts = append(p99Pts, fmt.Sprintf("%.1f,%.1f", xpos(panelLeft2, p.Writers), yP99(s.p99(p))))
		}
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", s.color, strings.Join(opsPts, " "))
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", s.color, strings.Join(p99Pts, " "))
		for _, p := range points {
			fmt.Fprintf(&b, `<circle class="point" cx="%.1f" cy="%.1f" r="3.5" fill="%s" data-writers="%d" data-value="%s"><title>%s</title></circle>`+"\n",
				xpos(panelLeft1, p.Writers), yOps(s.ops(p)), s.color, p.Writers, fmtFloat(s.ops(p)),
				esc(fmt.Sprintf("%s, %d writers: %s/s", s.name, p.Writers, fmtInt(s.ops(p)))))
			fmt.Fprintf(&b, `<circle class="point" cx="%.1f" cy="%.1f" r="3.5" fill="%s" data-writers="%d" data-value="%s"><title>%s</title></circle>`+"\n",
				xpos(panelLeft2, p.Writers), yP99(s.p99(p)), s.color, p.Writers, fmtFloat(s.p99(p)),
				esc(fmt.Sprintf("%s, %d writers: p99 %s ms", s.name, p.Writers, fmtNum(s.p99(p)))))
		}
	}

	// Legend.
	for i, s := range chartSeries {
		x := 160 + i*340
		y := chartH - 14
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="3"/>`+"\n", x, y, x+28, y, s.color)
		fmt.Fprintf(&b, `<text x="%d" y="%d" dominant-baseline="middle">%s</text>`+"\n", x+36, y, esc(s.name))
	}
	b.WriteString("</svg>\n")
	return b.String()
}

func panelFrame(b *strings.Builder, left int, label string) {
	fmt.Fprintf(b, `<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#999999"/>`+"\n", left, panelTop, panelW, panelH)
	fmt.Fprintf(b, `<text x="%d" y="%d" text-anchor="middle" font-weight="bold">%s</text>`+"\n", left+panelW/2, panelTop-8, esc(label))
}

// niceScale returns an axis top at or above v and a step giving about
// five gridlines, both round numbers.
func niceScale(v float64) (top, step float64) {
	if v <= 0 || math.IsNaN(v) || math.IsInf(v, 0) {
		return 1, 0.2
	}
	raw := v / 5
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if m*mag >= raw {
			step = m * mag
			break
		}
	}
	top = math.Ceil(v/step) * step
	return top, step
}

// shortNum writes axis labels: 12k, 1.5M, 0.1.
func shortNum(v float64) string {
	switch {
	case v >= 1e6:
		return trimZeros(fmt.Sprintf("%.2f", v/1e6)) + "M"
	case v >= 1e3:
		return trimZeros(fmt.Sprintf("%.2f", v/1e3)) + "k"
	}
	return trimZeros(fmt.Sprintf("%.3f", v))
}

func trimZeros(s string) string {
	if strings.Contains(s, ".") {
		s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	}
	return s
}

func fmtFloat(f float64) string { return trimZeros(fmt.Sprintf("%.3f", f)) }

func esc(s string) string { return html.EscapeString(s) }
