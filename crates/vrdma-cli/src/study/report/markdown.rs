//! The report as Markdown (GitHub tables; the charts referenced as
//! `charts/NAME.svg` beside it).

use super::Block;

fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

pub fn render(blocks: &[Block]) -> String {
    let mut out = String::new();
    for b in blocks {
        match b {
            Block::Heading(level, text) => {
                out += &format!("{} {text}\n\n", "#".repeat(*level as usize));
            }
            Block::Para(text) => out += &format!("{text}\n\n"),
            Block::List(items) => {
                for i in items {
                    out += &format!("- {}\n", i.replace('\n', " "));
                }
                out += "\n";
            }
            Block::Table { caption, header, rows, note } => {
                out += &format!("**{caption}**\n\n");
                out += &format!("| {} |\n", header.iter().map(|h| cell(h)).collect::<Vec<_>>().join(" | "));
                let align: Vec<&str> =
                    header.iter().enumerate().map(|(i, _)| if i == 0 { "---" } else { "---:" }).collect();
                out += &format!("|{}|\n", align.join("|"));
                for r in rows {
                    out += &format!("| {} |\n", r.iter().map(|c| cell(c)).collect::<Vec<_>>().join(" | "));
                }
                if rows.is_empty() {
                    out += &format!("| (no data) |{}\n", " |".repeat(header.len().saturating_sub(1)));
                }
                out += "\n";
                if let Some(n) = note {
                    out += &format!("{n}\n\n");
                }
            }
            Block::Figure { caption, name } => {
                out += &format!("![{caption}](charts/{name}.svg)\n\n*{caption}* (PNG: [charts/{name}.png](charts/{name}.png))\n\n");
            }
        }
    }
    out
}
