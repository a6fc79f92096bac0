//! A hand-written SVG plot: per-call latency and algorithm bandwidth against message size, two
//! log-log panels side by side, one line per series (NCCL, flashcomm lossless, each quantized
//! width, the copy baseline), with a shared legend. No plotting dependency.

use std::fmt::Write as _;

use crate::report::{Row, Variant};

/// One line of the plot.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// (size in bytes, per-call time in µs, algbw in GB/s), any order.
    pub points: Vec<(f64, f64, f64)>,
}

/// Groups the measured out-of-place rows into series: one per variant, launch mode (when a run
/// has both) and datatype (when it has several).
pub fn series_from_rows(rows: &[Row]) -> Vec<Series> {
    if rows.is_empty() {
        return Vec::new();
    }
    let many_launches = rows.iter().any(|r| r.launch != rows[0].launch);
    let many_types = rows.iter().any(|r| r.dtype != rows[0].dtype);
    let mut out: Vec<Series> = Vec::new();
    for r in rows {
        let Some(m) = r.out.measure() else { continue };
        // pull-best repeats a measured row.
        if r.variant.derived() {
            continue;
        }
        let mut label = r.variant.label();
        if r.variant == Variant::Lossless {
            label.push_str(" lossless");
        }
        if many_launches {
            label = format!("{label} ({})", r.launch.name());
        }
        if many_types {
            label = format!("{label} {}", r.dtype.long_name());
        }
        let p = (r.bytes as f64, m.time.median_us, r.algbw(m));
        match out.iter_mut().find(|s| s.label == label) {
            Some(s) => s.points.push(p),
            None => out.push(Series {
                label,
                points: vec![p],
            }),
        }
    }
    out
}

/// Escapes text for SVG content and attribute values.
pub fn escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            c if (c as u32) < 0x20 && c != '\n' && c != '\t' => {}
            c => o.push(c),
        }
    }
    o
}

const PALETTE: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    "#7f7f7f", "#bcbd22",
];

/// Human size label: 8, 4K, 1M, 2G.
pub fn size_label(bytes: f64) -> String {
    let b = bytes.round() as u64;
    for (shift, suffix) in [(30u32, "G"), (20, "M"), (10, "K")] {
        if b >= 1 << shift && b.is_multiple_of(1 << shift) {
            return format!("{}{suffix}", b >> shift);
        }
    }
    b.to_string()
}

fn num_label(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.6}");
        s.trim_end_matches('0').to_string()
    }
}

struct Axis {
    lo: f64,
    hi: f64,
}

impl Axis {
    /// A log axis covering `[min, max]` out to whole powers of `base`.
    fn log(min: f64, max: f64, base: f64) -> Axis {
        let (min, max) = if min.is_finite() && max.is_finite() && min > 0.0 && max >= min {
            (min, max)
        } else {
            (1.0, base)
        };
        let lo = (min.ln() / base.ln()).floor();
        let mut hi = (max.ln() / base.ln()).ceil();
        if hi <= lo {
            hi = lo + 1.0;
        }
        Axis {
            lo: base.powf(lo),
            hi: base.powf(hi),
        }
    }

    /// Position in [0, 1].
    fn frac(&self, v: f64) -> f64 {
        (v.ln() - self.lo.ln()) / (self.hi.ln() - self.lo.ln())
    }
}

struct Panel<'a> {
    x0: f64,
    y0: f64,
    w: f64,
    h: f64,
    title: &'a str,
    ylabel: &'a str,
}

fn draw_panel(
    svg: &mut String,
    p: &Panel,
    series: &[Series],
    xa: &Axis,
    pick: fn(&(f64, f64, f64)) -> f64,
) {
    let ys: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(pick))
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    let ya = Axis::log(
        ys.iter().copied().fold(f64::INFINITY, f64::min),
        ys.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        10.0,
    );
    let px = |v: f64| p.x0 + xa.frac(v) * p.w;
    let py = |v: f64| p.y0 + p.h - ya.frac(v) * p.h;
    let _ = writeln!(
        svg,
        r##"<rect x="{:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="#ffffff" stroke="#444444"/>"##,
        p.x0, p.y0, p.w, p.h
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="14" font-weight="bold">{}</text>"#,
        p.x0 + p.w / 2.0,
        p.y0 - 10.0,
        escape(p.title)
    );
    // x grid: powers of two, labelled every `step` so that at most ~10 labels show.
    let (xl, xh) = (xa.lo.log2().round() as i32, xa.hi.log2().round() as i32);
    let step = (((xh - xl) as f64) / 10.0).ceil().max(1.0) as i32;
    let mut e = xl;
    while e <= xh {
        let v = 2f64.powi(e);
        let x = px(v);
        let _ = writeln!(
            svg,
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#dddddd"/>"##,
            p.y0,
            p.y0 + p.h
        );
        let _ = writeln!(
            svg,
            r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle" font-size="11">{}</text>"#,
            p.y0 + p.h + 16.0,
            size_label(v)
        );
        e += step;
    }
    // y grid: decades.
    let (yl, yh) = (ya.lo.log10().round() as i32, ya.hi.log10().round() as i32);
    for d in yl..=yh {
        let v = 10f64.powi(d);
        let y = py(v);
        let _ = writeln!(
            svg,
            r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#dddddd"/>"##,
            p.x0,
            p.x0 + p.w
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="11">{}</text>"#,
            p.x0 - 6.0,
            y + 4.0,
            num_label(v)
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="12">message size (bytes)</text>"#,
        p.x0 + p.w / 2.0,
        p.y0 + p.h + 36.0
    );
    let (lx, ly) = (p.x0 - 48.0, p.y0 + p.h / 2.0);
    let _ = writeln!(
        svg,
        r#"<text x="{lx:.1}" y="{ly:.1}" text-anchor="middle" font-size="12" transform="rotate(-90 {lx:.1} {ly:.1})">{}</text>"#,
        escape(p.ylabel)
    );
    for (i, s) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let mut pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .map(|t| (t.0, pick(t)))
            .filter(|(x, y)| x.is_finite() && *x > 0.0 && y.is_finite() && *y > 0.0)
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        if pts.is_empty() {
            continue;
        }
        let path: Vec<String> = pts
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            path.join(" ")
        );
        for &(x, y) in &pts {
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{color}"/>"#,
                px(x),
                py(y)
            );
        }
    }
}

/// The whole SVG document.
pub fn render(title: &str, subtitle: &str, series: &[Series]) -> String {
    let (pw, ph) = (520.0, 380.0);
    let (left, top, gap) = (80.0, 80.0, 110.0);
    let legend_rows = series.len().div_ceil(3).max(1) as f64;
    let width = left + 2.0 * pw + gap + 40.0;
    let height = top + ph + 60.0 + 22.0 * legend_rows + 20.0;
    let xs: Vec<f64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    let xa = Axis::log(
        xs.iter().copied().fold(f64::INFINITY, f64::min),
        xs.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        2.0,
    );
    let mut svg = String::new();
    let _ = writeln!(svg, r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif">"#
    );
    let _ = writeln!(
        svg,
        r##"<rect x="0" y="0" width="{width:.0}" height="{height:.0}" fill="#fafafa"/>"##
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="26" text-anchor="middle" font-size="17" font-weight="bold">{}</text>"#,
        width / 2.0,
        escape(title)
    );
    let _ = writeln!(
        svg,
        r##"<text x="{:.1}" y="46" text-anchor="middle" font-size="12" fill="#555555">{}</text>"##,
        width / 2.0,
        escape(subtitle)
    );
    draw_panel(
        &mut svg,
        &Panel {
            x0: left,
            y0: top,
            w: pw,
            h: ph,
            title: "latency per call",
            ylabel: "time (us)",
        },
        series,
        &xa,
        |p| p.1,
    );
    draw_panel(
        &mut svg,
        &Panel {
            x0: left + pw + gap,
            y0: top,
            w: pw,
            h: ph,
            title: "algorithm bandwidth",
            ylabel: "algbw (GB/s)",
        },
        series,
        &xa,
        |p| p.2,
    );
    let ly0 = top + ph + 60.0;
    for (i, s) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let (col, row) = ((i % 3) as f64, (i / 3) as f64);
        let x = left + col * (2.0 * pw + gap) / 3.0;
        let y = ly0 + row * 22.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{x:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="{color}" stroke-width="3"/>"#,
            x + 26.0
        );
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#,
            x + 32.0,
            y + 4.0,
            escape(&s.label)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{Launch, Width};
    use crate::report::tests::row;

    /// A small XML well-formedness check: balanced and properly nested elements, quoted
    /// attributes, no stray `<` or `&` in text.
    fn well_formed(doc: &str) -> Result<(), String> {
        let mut stack: Vec<String> = Vec::new();
        let mut rest = doc;
        let mut roots = 0;
        while let Some(i) = rest.find(['<', '&']) {
            let text = &rest[..i];
            if text.contains('>') {
                return Err(format!("stray '>' in text {text:?}"));
            }
            rest = &rest[i..];
            if rest.starts_with('&') {
                let end = rest.find(';').ok_or("unterminated entity")?;
                let ent = &rest[1..end];
                if !["amp", "lt", "gt", "quot", "apos"].contains(&ent) {
                    return Err(format!("unknown entity &{ent};"));
                }
                rest = &rest[end + 1..];
                continue;
            }
            let end = rest.find('>').ok_or("unterminated tag")?;
            let tag = &rest[1..end];
            rest = &rest[end + 1..];
            if tag.starts_with('?') {
                if !tag.ends_with('?') {
                    return Err("bad declaration".into());
                }
                continue;
            }
            if let Some(name) = tag.strip_prefix('/') {
                let open = stack
                    .pop()
                    .ok_or(format!("</{name}> without an open tag"))?;
                if open != name.trim() {
                    return Err(format!("</{name}> closes <{open}>"));
                }
                continue;
            }
            let self_closing = tag.ends_with('/');
            let body = tag.trim_end_matches('/');
            let name = body.split_whitespace().next().ok_or("empty tag")?;
            if !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == ':')
            {
                return Err(format!("bad element name {name:?}"));
            }
            // Attributes: name="value" pairs, values without '<' or '"'.
            let mut attrs = body[name.len()..].trim();
            while !attrs.is_empty() {
                let eq = attrs
                    .find('=')
                    .ok_or(format!("attribute without value in <{name}>"))?;
                let an = attrs[..eq].trim();
                if an.is_empty() || an.contains(char::is_whitespace) {
                    return Err(format!("bad attribute name {an:?}"));
                }
                let v = attrs[eq + 1..].trim_start();
                let v = v
                    .strip_prefix('"')
                    .ok_or(format!("unquoted attribute {an}"))?;
                let close = v.find('"').ok_or("unterminated attribute")?;
                if v[..close].contains('<') {
                    return Err("'<' in an attribute".into());
                }
                attrs = v[close + 1..].trim_start();
            }
            if stack.is_empty() {
                roots += 1;
            }
            if !self_closing {
                stack.push(name.to_string());
            }
        }
        if !rest.trim().is_empty() {
            return Err("text after the root element".into());
        }
        if !stack.is_empty() {
            return Err(format!("unclosed elements {stack:?}"));
        }
        if roots != 1 {
            return Err(format!("{roots} root elements"));
        }
        Ok(())
    }

    #[test]
    fn checker_rejects_broken_documents() {
        assert!(well_formed("<svg><g></svg>").is_err());
        assert!(well_formed("<svg a=1></svg>").is_err());
        assert!(well_formed("<svg>a & b</svg>").is_err());
        assert!(well_formed("<svg></svg><svg></svg>").is_err());
        assert!(well_formed(r#"<svg a="1"><g/></svg>"#).is_ok());
    }

    #[test]
    fn plot_is_well_formed_with_one_line_per_series() {
        let mut rows = Vec::new();
        for (i, b) in [4096u64, 8192, 16384, 1 << 20].iter().enumerate() {
            let t = 5.0 + i as f64;
            rows.push(row(Variant::Nccl, Launch::Eager, *b, t * 2.0));
            rows.push(row(Variant::Lossless, Launch::Eager, *b, t));
            rows.push(row(
                Variant::Quant(Width { rs: 4, ag: 4 }),
                Launch::Eager,
                *b,
                t * 0.7,
            ));
            rows.push(row(
                Variant::Quant(Width { rs: 2, ag: 2 }),
                Launch::Eager,
                *b,
                t * 0.6,
            ));
        }
        let series = series_from_rows(&rows);
        let labels: Vec<&str> = series.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(
            labels,
            vec!["nccl", "flashcomm lossless", "flashcomm-q4", "flashcomm-q2"]
        );
        assert!(series.iter().all(|s| s.points.len() == 4));
        let svg = render("AllReduce <8 ranks> & \"quotes\"", "H200, virtual", &series);
        well_formed(&svg).unwrap();
        assert!(svg.starts_with("<?xml"));
        // Two panels, each with one polyline per series.
        assert_eq!(svg.matches("<polyline").count(), 2 * series.len());
        assert!(svg.contains("&lt;8 ranks&gt; &amp; &quot;quotes&quot;"));
        assert!(svg.contains(">4K<") && svg.contains(">1M<"));
    }

    #[test]
    fn degenerate_inputs_still_make_a_valid_file() {
        well_formed(&render("empty", "", &[])).unwrap();
        let one = vec![Series {
            label: "x".into(),
            points: vec![(8.0, 0.0, f64::NAN), (16.0, 3.0, 1.0)],
        }];
        well_formed(&render("one", "", &one)).unwrap();
        let mixed = vec![
            row(Variant::Lossless, Launch::Eager, 4096, 1.0),
            row(Variant::Lossless, Launch::Graph, 4096, 1.0),
        ];
        let s = series_from_rows(&mixed);
        assert_eq!(s.len(), 2);
        assert_eq!(s[1].label, "flashcomm lossless (graph)");
    }

    #[test]
    fn labels() {
        assert_eq!(size_label(8.0), "8");
        assert_eq!(size_label(4096.0), "4K");
        assert_eq!(size_label(3.0 * 1048576.0), "3M");
        assert_eq!(size_label(2.0 * 1073741824.0), "2G");
        assert_eq!(num_label(100.0), "100");
        assert_eq!(num_label(0.01), "0.01");
        assert_eq!(escape("a<b>&\"'"), "a&lt;b&gt;&amp;&quot;&apos;");
    }
}
