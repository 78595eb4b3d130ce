//! SVG plots (plotters, SVG backend only) of the strategy table and the sweep: per workload,
//! one panel per strategy with the plotted key's admitted rate against the contract over
//! time; the sweep's bound, coordination and false rejections against the max grant.

use super::measure::{Bin, BIN_MS};
use anyhow::{anyhow, Result};
use plotters::prelude::*;
use std::path::Path;

/// One strategy's panel: its label and bins.
pub struct Panel<'a> {
    /// Title.
    pub label: &'a str,
    /// The plotted key's bins of [`BIN_MS`].
    pub bins: &'a [Bin],
}

/// What the panels share: the contract's rate r (tokens/s), the allocator partition (s) and the
/// run's length (s).
pub struct Frame {
    /// The contract's refill rate, tokens per second.
    pub rate: f64,
    /// The allocator partition, s.
    pub partition_s: (f64, f64),
    /// The run's length, s.
    pub duration_s: f64,
    /// The title above the panels.
    pub title: String,
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plot: {e:?}")
}

/// Writes `panels` stacked in one SVG at `path`.
///
/// # Errors
/// The file cannot be written.
pub fn admitted_rate(path: &Path, frame: &Frame, panels: &[Panel<'_>]) -> Result<()> {
    let height = 60 + 190 * panels.len() as u32;
    let root = SVGBackend::new(path, (900, height)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(&frame.title, ("sans-serif", 20)).map_err(err)?;
    let per_s = 1_000.0 / BIN_MS as f64;
    let top = panels
        .iter()
        .flat_map(|p| p.bins.iter().map(|b| b.offered.max(b.admitted)))
        .fold(frame.rate * 2.0, f64::max)
        * per_s
        * 1.05;
    for (area, p) in root.split_evenly((panels.len(), 1)).iter().zip(panels) {
        draw_panel(area, frame, p, top, per_s)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

fn draw_panel(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    frame: &Frame,
    p: &Panel<'_>,
    top: f64,
    per_s: f64,
) -> Result<()> {
    let mut chart = ChartBuilder::on(area)
        .caption(p.label, ("sans-serif", 15))
        .margin(6)
        .x_label_area_size(28)
        .y_label_area_size(48)
        .build_cartesian_2d(0.0..frame.duration_s, 0.0..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc("tokens/s")
        .light_line_style(WHITE)
        .draw()
        .map_err(err)?;
    let (p0, p1) = frame.partition_s;
    chart
        .draw_series(std::iter::once(Rectangle::new(
            [(p0, 0.0), (p1, top)],
            RGBColor(255, 228, 196).filled(),
        )))
        .map_err(err)?
        .label("allocator partition")
        .legend(|(x, y)| {
            Rectangle::new(
                [(x, y - 5), (x + 16, y + 5)],
                RGBColor(255, 228, 196).filled(),
            )
        });
    let bin_s = BIN_MS as f64 / 1_000.0;
    let step = |f: fn(&Bin) -> f64| -> Vec<(f64, f64)> {
        p.bins
            .iter()
            .enumerate()
            .flat_map(|(i, b)| {
                let x = i as f64 * bin_s;
                [(x, f(b) * per_s), (x + bin_s, f(b) * per_s)]
            })
            .collect()
    };
    let grey = RGBColor(170, 170, 170);
    chart
        .draw_series(LineSeries::new(step(|b| b.offered), grey.stroke_width(1)))
        .map_err(err)?
        .label("offered")
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], grey));
    chart
        .draw_series(DashedLineSeries::new(
            step(|b| b.ideal),
            5,
            3,
            BLACK.stroke_width(1),
        ))
        .map_err(err)?
        .label("ideal central counter")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK));
    chart
        .draw_series(LineSeries::new(step(|b| b.admitted), BLUE.stroke_width(2)))
        .map_err(err)?
        .label("admitted")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLUE.stroke_width(2)));
    chart
        .draw_series(LineSeries::new(
            [(0.0, frame.rate), (frame.duration_s, frame.rate)],
            RED.stroke_width(1),
        ))
        .map_err(err)?
        .label("contract rate r")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], RED));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(grey)
        .label_font(("sans-serif", 11))
        .draw()
        .map_err(err)?;
    Ok(())
}

/// One line of a sweep panel: its label and points (x, y).
pub struct Line {
    /// Legend.
    pub label: String,
    /// Points.
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed (a computed bound, not a measurement).
    pub dashed: bool,
}

/// One panel of the sweep plot.
pub struct SweepPanel {
    /// Title.
    pub title: String,
    /// X axis.
    pub x_desc: String,
    /// Y axis.
    pub y_desc: String,
    /// Lines.
    pub lines: Vec<Line>,
}

/// Writes the sweep's panels side by side in one SVG at `path`.
///
/// # Errors
/// The file cannot be written.
pub fn sweep(path: &Path, title: &str, panels: &[SweepPanel]) -> Result<()> {
    let root = SVGBackend::new(path, (420 * panels.len() as u32, 400)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 18)).map_err(err)?;
    let palette = [BLUE, RED, RGBColor(0, 140, 0), RGBColor(160, 0, 160), BLACK];
    for (area, p) in root.split_evenly((1, panels.len())).iter().zip(panels) {
        let pts = p.lines.iter().flat_map(|l| l.points.iter());
        let x_max = pts.clone().map(|p| p.0).fold(1.0, f64::max) * 1.05;
        let y_max = pts.map(|p| p.1).fold(1.0, f64::max) * 1.1;
        let mut chart = ChartBuilder::on(area)
            .caption(&p.title, ("sans-serif", 14))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(&p.x_desc)
            .y_desc(&p.y_desc)
            .light_line_style(WHITE)
            .draw()
            .map_err(err)?;
        for (i, l) in p.lines.iter().enumerate() {
            let color = palette[i % palette.len()];
            let series = if l.dashed {
                chart.draw_series(DashedLineSeries::new(
                    l.points.clone(),
                    5,
                    3,
                    color.stroke_width(1),
                ))
            } else {
                chart.draw_series(LineSeries::new(l.points.clone(), color.stroke_width(2)))
            };
            series
                .map_err(err)?
                .label(&l.label)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
            if !l.dashed {
                chart
                    .draw_series(l.points.iter().map(|p| Circle::new(*p, 3, color.filled())))
                    .map_err(err)?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 11))
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}
