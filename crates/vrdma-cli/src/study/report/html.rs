//! The report as one self-contained HTML page: the same blocks, the
//! charts' SVGs inline, a little CSS.

use std::collections::BTreeMap;

use super::Block;

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Escapes `s` and turns Markdown's `**bold**` and `` `code` `` into tags.
fn inline(s: &str) -> String {
    let mut out = String::new();
    let (mut bold, mut code) = (false, false);
    let e = escape(s);
    let mut rest = e.as_str();
    while let Some(c) = rest.chars().next() {
        if rest.starts_with("**") && !code {
            out += if bold { "</strong>" } else { "<strong>" };
            bold = !bold;
            rest = &rest[2..];
        } else if c == '`' {
            out += if code { "</code>" } else { "<code>" };
            code = !code;
            rest = &rest[1..];
        } else {
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    if code {
        out += "</code>";
    }
    if bold {
        out += "</strong>";
    }
    out
}

const STYLE: &str = "body{font-family:sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}\
table{border-collapse:collapse;margin:.5em 0 1em;font-size:13px}\
th,td{border-top:1px solid #999;border-bottom:1px solid #999;padding:3px 8px;text-align:right}\
th:first-child,td:first-child{text-align:left}th{background:#f0f0f0}\
caption{caption-side:top;text-align:left;font-weight:bold;padding-bottom:4px}\
figure{margin:1em 0}figcaption{font-style:italic}.note{font-size:13px;color:#444}\
code{background:#f4f4f4;padding:0 3px}";

pub fn render(blocks: &[Block], svgs: &BTreeMap<&str, String>) -> String {
    let title = blocks
        .iter()
        .find_map(|b| if let Block::Heading(1, t) = b { Some(t.clone()) } else { None })
        .unwrap_or_else(|| "vRDMA study".into());
    let mut out = format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n",
        escape(&title)
    );
    for b in blocks {
        match b {
            Block::Heading(level, text) => out += &format!("<h{level}>{}</h{level}>\n", inline(text)),
            Block::Para(text) => out += &format!("<p>{}</p>\n", inline(text)),
            Block::List(items) => {
                out += "<ul>\n";
                for i in items {
                    out += &format!("<li>{}</li>\n", inline(i));
                }
                out += "</ul>\n";
            }
            Block::Table { caption, header, rows, note } => {
                out += &format!("<table>\n<caption>{}</caption>\n<thead><tr>", inline(caption));
                for h in header {
                    out += &format!("<th>{}</th>", inline(h));
                }
                out += "</tr></thead>\n<tbody>\n";
                for r in rows {
                    out += "<tr>";
                    for c in r {
                        out += &format!("<td>{}</td>", inline(c));
                    }
                    out += "</tr>\n";
                }
                if rows.is_empty() {
                    out += &format!("<tr><td colspan=\"{}\">(no data)</td></tr>\n", header.len());
                }
                out += "</tbody>\n</table>\n";
                if let Some(n) = note {
                    out += &format!("<p class=\"note\">{}</p>\n", inline(n));
                }
            }
            Block::Figure { caption, name } => {
                let svg = svgs.get(name.as_str()).map_or("", |s| s.as_str());
                // The SVG's own XML declaration, if any, cannot stand inside HTML.
                let svg = match svg.find("<svg") {
                    Some(i) => &svg[i..],
                    None => svg,
                };
                out += &format!("<figure>\n{svg}\n<figcaption>{}</figcaption>\n</figure>\n", inline(caption));
            }
        }
    }
    out += "</body>\n</html>\n";
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_markup_and_escaping() {
        assert_eq!(inline("**1.5** <x> `a&b`"), "<strong>1.5</strong> &lt;x&gt; <code>a&amp;b</code>");
        assert_eq!(inline("unclosed **b"), "unclosed <strong>b</strong>");
    }
}
