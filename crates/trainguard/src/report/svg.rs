//! Drawing one panel as inline SVG: axes with round ticks, polylines (or staircases), horizontal
//! reference lines and vertical event markers. Written by hand rather than with a plotting crate:
//! the page needs a few kinds of element, and owning the markup lets each element carry its data
//! (`data-key`, `data-step`, the axis domain on the `<svg>`) for the page's script and the tests.
use std::fmt::Write;

/// viewBox size and plot area (left, right, top, bottom) in SVG units.
pub const W: f64 = 960.0;
pub const H: f64 = 240.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = W - 16.0;
const TOP: f64 = 12.0;
const BOTTOM: f64 = H - 30.0;

pub struct Line {
    pub run: usize,
    pub key: &'static str,
    pub color: &'static str,
    pub dash: &'static str,
    /// (x, y) in axis units.
    pub points: Vec<(f64, f64)>,
    pub staircase: bool,
}

pub struct HLine {
    pub label: String,
    pub y: f64,
    pub color: &'static str,
}

pub struct VMark {
    pub x: f64,
    pub step: u64,
    pub kind: String,
    pub label: String,
    pub color: &'static str,
}

pub struct Panel<'a> {
    pub id: &'a str,
    pub axis: &'a str,
    pub x_label: &'a str,
    /// Seconds per x unit on a wall-time axis (1 on a step axis).
    pub x_unit_s: f64,
    pub x: (f64, f64),
    pub from_zero: bool,
    pub lines: &'a [Line],
    pub hlines: &'a [HLine],
    pub marks: &'a [VMark],
}

/// Escapes text for HTML/SVG content and attribute values.
pub fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A short number for tick labels and readouts.
pub fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-3..1e6).contains(&a) {
        format!("{v:.1e}")
    } else {
        let s = format!("{v:.4}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        s.to_string()
    }
}

/// About `n` round ticks (1, 2, 5 × 10^k) covering [lo, hi].
pub fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let span = hi - lo;
    if span.is_nan() || span <= 0.0 || span.is_infinite() {
        return vec![lo];
    }
    let raw = span / n as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step =
        [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| span / s <= n as f64).unwrap_or(10.0 * mag);
    let first = (lo / step).ceil() as i64;
    let last = (hi / step).floor() as i64;
    (first..=last).map(|i| i as f64 * step).collect()
}

/// The y domain: every point and reference line, padded 5%; never empty.
fn y_domain(p: &Panel) -> (f64, f64) {
    let ys = p
        .lines
        .iter()
        .flat_map(|l| l.points.iter().map(|q| q.1))
        .chain(p.hlines.iter().map(|h| h.y))
        .filter(|y| y.is_finite());
    let (mut lo, hi) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| (a.min(y), b.max(y)));
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if p.from_zero {
        lo = lo.min(0.0);
    }
    if hi - lo <= f64::EPSILON * hi.abs().max(1e-300) {
        let d = if hi == 0.0 { 1.0 } else { hi.abs() * 0.1 };
        return (lo - if p.from_zero && lo == 0.0 { 0.0 } else { d }, hi + d);
    }
    let pad = (hi - lo) * 0.05;
    (if p.from_zero && lo >= 0.0 { lo } else { lo - pad }, hi + pad)
}

pub fn render(p: &Panel) -> String {
    let (x0, x1) = if p.x.1 > p.x.0 { p.x } else { (p.x.0, p.x.0 + 1.0) };
    let (y0, y1) = y_domain(p);
    let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * (RIGHT - LEFT);
    let sy = |y: f64| BOTTOM - (y - y0) / (y1 - y0) * (BOTTOM - TOP);
    let mut o = String::new();
    let keys: Vec<&str> = {
        let mut k: Vec<&str> = p.lines.iter().map(|l| l.key).collect();
        k.dedup();
        k
    };
    let _ = write!(
        o,
        r#"<svg class="panel" id="{id}-{axis}" data-panel="{id}" data-axis="{axis}" data-keys="{keys}" data-x0="{x0}" data-x1="{x1}" data-y0="{y0}" data-y1="{y1}" data-xunit="{u}" data-left="{LEFT}" data-right="{RIGHT}" data-top="{TOP}" data-bottom="{BOTTOM}" viewBox="0 0 {W} {H}" preserveAspectRatio="none" role="img">"#,
        id = p.id,
        axis = p.axis,
        keys = keys.join(" "),
        u = p.x_unit_s,
    );
    // Grid and tick labels.
    o.push_str(r##"<g class="grid" stroke="#e4e4e4" stroke-width="1">"##);
    let (xt, yt) = (ticks(x0, x1, 8), ticks(y0, y1, 5));
    for &t in &xt {
        let _ = write!(o, r#"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{BOTTOM}"/>"#, x = sx(t));
    }
    for &t in &yt {
        let _ = write!(o, r#"<line x1="{LEFT}" y1="{y:.1}" x2="{RIGHT}" y2="{y:.1}"/>"#, y = sy(t));
    }
    o.push_str("</g>");
    let _ = write!(
        o,
        r##"<rect x="{LEFT}" y="{TOP}" width="{}" height="{}" fill="none" stroke="#999"/>"##,
        RIGHT - LEFT,
        BOTTOM - TOP
    );
    o.push_str(r##"<g class="ticks" font-size="11" fill="#444" font-family="sans-serif">"##);
    for &t in &xt {
        let _ = write!(
            o,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            sx(t),
            BOTTOM + 14.0,
            fmt_num(t)
        );
    }
    for &t in &yt {
        let _ = write!(
            o,
            r#"<text x="{}" y="{:.1}" text-anchor="end" dominant-baseline="middle">{}</text>"#,
            LEFT - 5.0,
            sy(t),
            fmt_num(t)
        );
    }
    let _ = write!(
        o,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text></g>"#,
        (LEFT + RIGHT) / 2.0,
        H - 2.0,
        esc(p.x_label)
    );

    for h in p.hlines {
        let y = sy(h.y);
        let _ = write!(
            o,
            r#"<g class="hline" data-y="{yv}"><line x1="{LEFT}" y1="{y:.1}" x2="{RIGHT}" y2="{y:.1}" stroke="{c}" stroke-width="1.5" stroke-dasharray="10 4"/><text x="{tx}" y="{ty:.1}" text-anchor="end" font-size="11" font-family="sans-serif" fill="{c}">{l}</text><title>{l}</title></g>"#,
            c = h.color,
            tx = RIGHT - 4.0,
            ty = y - 4.0,
            l = esc(&h.label),
            yv = h.y,
        );
    }
    for l in p.lines {
        let mut pts = String::new();
        let mut prev: Option<f64> = None;
        for &(x, y) in &l.points {
            if let (true, Some(py)) = (l.staircase, prev) {
                let _ = write!(pts, "{:.2},{:.2} ", sx(x), sy(py));
            }
            let _ = write!(pts, "{:.2},{:.2} ", sx(x), sy(y));
            prev = Some(y);
        }
        let dash =
            if l.dash.is_empty() { String::new() } else { format!(r#" stroke-dasharray="{}""#, l.dash) };
        let stairs = if l.staircase { r#" data-stairs="1""# } else { "" };
        let _ = write!(
            o,
            r#"<polyline class="series" data-run="{}" data-key="{}"{stairs} fill="none" stroke="{}" stroke-width="1.5"{dash} stroke-linejoin="round" points="{}"/>"#,
            l.run,
            l.key,
            l.color,
            pts.trim_end()
        );
        // Sparse curves (validation loss) also get dots: a single point has no line to show it.
        if l.points.len() <= 60 {
            for &(x, y) in &l.points {
                let _ = write!(
                    o,
                    r#"<circle class="dot" cx="{:.2}" cy="{:.2}" r="2.5" fill="{}"/>"#,
                    sx(x),
                    sy(y),
                    l.color
                );
            }
        }
    }
    for m in p.marks {
        let x = sx(m.x);
        let _ = write!(
            o,
            r#"<g class="marker" data-kind="{k}" data-step="{s}" data-x="{xv}"><line x1="{x:.2}" y1="{TOP}" x2="{x:.2}" y2="{BOTTOM}" stroke="{c}" stroke-width="1.2" stroke-dasharray="3 3"/><path d="M{a:.2} {TOP} l8 0 l-4 7 z" fill="{c}"/><title>step {s}: {l}</title></g>"#,
            k = esc(&m.kind),
            s = m.step,
            c = m.color,
            a = x - 4.0,
            l = esc(&m.label),
            xv = m.x,
        );
    }
    let _ = write!(
        o,
        r##"<line class="guide" x1="0" y1="{TOP}" x2="0" y2="{BOTTOM}" stroke="#555" stroke-width="1" visibility="hidden"/></svg>"##
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_inside() {
        assert_eq!(ticks(0.0, 10.0, 5), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(ticks(1.3, 5.6, 5), vec![2.0, 3.0, 4.0, 5.0]);
        assert_eq!(ticks(3.0, 3.0, 5), vec![3.0]);
        let t = ticks(0.0, 3e-3, 5);
        assert!(t.len() >= 3 && t.iter().all(|v| (0.0..=3e-3).contains(v)));
    }

    #[test]
    fn numbers_are_short() {
        assert_eq!(fmt_num(2.5), "2.5");
        assert_eq!(fmt_num(3e-4), "3.0e-4");
        assert_eq!(fmt_num(120000.0), "120000");
        assert_eq!(fmt_num(0.0), "0");
    }

    #[test]
    fn polyline_maps_points_into_the_plot_area() {
        let lines = [Line {
            run: 0,
            key: "loss",
            color: "#000",
            dash: "",
            points: vec![(0.0, 1.0), (10.0, 3.0)],
            staircase: false,
        }];
        let svg = render(&Panel {
            id: "loss",
            axis: "step",
            x_label: "step",
            x_unit_s: 1.0,
            x: (0.0, 10.0),
            from_zero: false,
            lines: &lines,
            hlines: &[],
            marks: &[],
        });
        // y domain 1..3 padded by 5% of 2: 0.9..3.1.
        let y = |v: f64| BOTTOM - (v - 0.9) / 2.2 * (BOTTOM - TOP);
        let want = format!(r#"points="{LEFT:.2},{:.2} {RIGHT:.2},{:.2}""#, y(1.0), y(3.0));
        assert!(svg.contains(&want), "{want} not in {svg}");
    }
}
