//! Line charts, one line per target or router: against the offered rate (the charts
//! gateways are compared with) or against time. SVG only, so no system fonts are needed
//! (text is left to the viewer; plotters' built-in size estimate lays it out).

use plotters::prelude::*;

/// One named line of `(x, value)` points.
pub type Line = (String, Vec<(f64, f64)>);

/// The x axis of the charts against the offered rate.
pub const OFFERED_RATE: &str = "offered rate (requests/s)";

/// An SVG document: `lines` against `x_label`. Points are sorted by x, since stages need
/// not ramp monotonically (the published llm-d run starts at 15).
pub fn line_chart(title: &str, x_label: &str, y_label: &str, mut lines: Vec<Line>) -> anyhow::Result<String> {
    for (_, points) in &mut lines {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let max = |f: fn(&(f64, f64)) -> f64| {
        lines
            .iter()
            .flat_map(|(_, p)| p.iter().map(f))
            .fold(0.0, f64::max)
    };
    // Non-zero ranges even for an empty or all-failed run, which plotters cannot scale.
    let x_max = max(|p| p.0).max(1e-3) * 1.05;
    let y_max = max(|p| p.1).max(1e-3) * 1.1;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
        chart.configure_mesh().x_desc(x_label).y_desc(y_label).draw()?;
        for (i, (name, points)) in lines.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}
