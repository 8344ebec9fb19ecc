//! Grouped bar charts with min–max whiskers, drawn once with plotters
//! onto an SVG and onto an RGB bitmap (written as PNG). Text uses DejaVu
//! Sans, embedded in the binary (Bitstream Vera license, see
//! assets/fonts/LICENSE-DejaVu.txt), through plotters' ab_glyph support.

use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

static FONT: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";

fn register_font() -> Result<()> {
    static ONCE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *ONCE.get_or_init(|| plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_ok());
    if ok {
        Ok(())
    } else {
        Err(anyhow!("the embedded font did not load"))
    }
}

/// One bar: its series (colour), height and whisker.
#[derive(Debug, Clone)]
pub struct Bar {
    pub series: usize,
    pub value: f64,
    pub min: f64,
    pub max: f64,
}

/// Bars drawn side by side under one label.
#[derive(Debug, Clone)]
pub struct Group {
    pub label: String,
    pub bars: Vec<Bar>,
}

#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    pub y_label: String,
    pub series: Vec<String>,
    pub groups: Vec<Group>,
    /// A fixed top of the y axis (shares in %), else from the data.
    pub y_max: Option<f64>,
}

const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

pub const WIDTH: u32 = 960;
pub const HEIGHT: u32 = 480;

impl Chart {
    /// The chart as an SVG document.
    pub fn svg(&self) -> Result<String> {
        register_font()?;
        let mut s = String::new();
        {
            let root = SVGBackend::with_string(&mut s, (WIDTH, HEIGHT)).into_drawing_area();
            self.draw(&root)?;
            root.present().map_err(|e| anyhow!("{e}"))?;
        }
        Ok(s)
    }

    /// The chart as a PNG file's bytes.
    pub fn png(&self) -> Result<Vec<u8>> {
        register_font()?;
        let mut rgb = vec![0u8; (WIDTH * HEIGHT * 3) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut rgb, (WIDTH, HEIGHT)).into_drawing_area();
            self.draw(&root)?;
            root.present().map_err(|e| anyhow!("{e}"))?;
        }
        let mut out = Vec::new();
        {
            let mut enc = png::Encoder::new(&mut out, WIDTH, HEIGHT);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            let mut w = enc.write_header()?;
            w.write_image_data(&rgb)?;
        }
        Ok(out)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing the chart: {e}");
        root.fill(&WHITE).map_err(err)?;
        let top = self.y_max.unwrap_or_else(|| {
            let m = self.groups.iter().flat_map(|g| &g.bars).map(|b| b.max.max(b.value)).fold(0.0, f64::max);
            if m > 0.0 && m.is_finite() {
                m * 1.3
            } else {
                1.0
            }
        });
        let n = self.groups.len().max(1);
        let mut chart = ChartBuilder::on(root)
            .caption(&self.title, (FAMILY, 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..n as f64, 0f64..top)
            .map_err(err)?;
        let labels: Vec<String> = self.groups.iter().map(|g| g.label.clone()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(WHITE)
            .x_labels(n * 2 + 1)
            .x_label_formatter(&|x| {
                // Labels at the middle of each group only.
                let i = x.floor() as usize;
                if (x - i as f64 - 0.5).abs() < 1e-6 {
                    labels.get(i).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc(&self.y_label)
            .label_style((FAMILY, 12))
            .axis_desc_style((FAMILY, 14))
            .draw()
            .map_err(err)?;
        let slots = self.series.len().max(1) as f64;
        let width = 0.8 / slots;
        for (gi, g) in self.groups.iter().enumerate() {
            for b in &g.bars {
                let x0 = gi as f64 + 0.1 + b.series as f64 * width;
                let colour = PALETTE[b.series % PALETTE.len()];
                let v = b.value.max(0.0);
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(x0, 0.0), (x0 + width * 0.9, v)],
                        colour.filled(),
                    )))
                    .map_err(err)?;
                if b.max > b.min {
                    let xm = x0 + width * 0.45;
                    let tick = width * 0.2;
                    let lines = [
                        vec![(xm, b.min), (xm, b.max)],
                        vec![(xm - tick, b.min), (xm + tick, b.min)],
                        vec![(xm - tick, b.max), (xm + tick, b.max)],
                    ];
                    for l in lines {
                        chart
                            .draw_series(std::iter::once(PathElement::new(l, BLACK.stroke_width(1))))
                            .map_err(err)?;
                    }
                }
            }
        }
        // The legend, drawn by hand (one entry per series).
        for (i, name) in self.series.iter().enumerate() {
            let colour = PALETTE[i % PALETTE.len()];
            chart
                .draw_series(std::iter::once(Rectangle::new([(0.0, 0.0), (0.0, 0.0)], colour.filled())))
                .map_err(err)?
                .label(name)
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font((FAMILY, 13))
            .draw()
            .map_err(err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_render_to_svg_and_png() {
        let c = Chart {
            title: "t".into(),
            y_label: "GB/s".into(),
            series: vec!["a".into(), "b".into()],
            groups: vec![Group {
                label: "g".into(),
                bars: vec![
                    Bar { series: 0, value: 1.0, min: 0.5, max: 1.5 },
                    Bar { series: 1, value: 2.0, min: 2.0, max: 2.0 },
                ],
            }],
            y_max: None,
        };
        let svg = c.svg().unwrap();
        assert!(svg.contains("<svg") && svg.contains("GB/s"), "{svg}");
        let png = c.png().unwrap();
        assert!(png.starts_with(&[0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a]));
        assert!(png.len() > 2000);
    }
}
