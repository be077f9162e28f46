// A small SVG line plot (no plotting dependency): several series over a shared x axis, with
// axes, "nice" ticks, a title and a legend. Used for max/mean over steps by `moe-echo simulate`.
//
// Invariants: the output is a standalone SVG 1.1 document; non-finite points are skipped; the y
// range always includes the values of every series (and y_min when given).
//
// Part of the offline tools: library moe_echo_offline (CPU only), src/offline/svg_plot.cpp.
#pragma once

#include <limits>
#include <string>
#include <vector>

namespace moe_echo::offline {

struct PlotSeries {
  std::string label;
  std::vector<double> y;  // y[i] is drawn at x = x0 + i * dx
  std::string color;      // empty: a default palette
};

struct LinePlot {
  std::string title;
  std::string x_label = "step";
  std::string y_label;
  double x0 = 0, dx = 1;
  double y_min = std::numeric_limits<double>::quiet_NaN();  // NaN: from the data
  int width = 900, height = 480;
  std::vector<PlotSeries> series;
};

// The SVG text of the plot.
std::string render_svg(const LinePlot& plot);
// Writes render_svg(plot) to `path`; throws moe_echo::Error when the file cannot be written.
void write_svg(const LinePlot& plot, const std::string& path);

// Up to `count` round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten).
std::vector<double> nice_ticks(double lo, double hi, int count);

}  // namespace moe_echo::offline
