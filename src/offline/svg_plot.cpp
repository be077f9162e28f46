#include "moe_echo/svg_plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"

namespace moe_echo::offline {
namespace {

const char* const kPalette[] = {"#d62728", "#1f77b4", "#2ca02c", "#7f7f7f",
                                "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"};

std::string escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

std::string num(double v, int precision = 2) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", precision, v);
  return buf;
}

std::string tick_label(double v, double step) {
  int digits = 0;
  while (digits < 6 && std::fabs(step * std::pow(10.0, digits) -
                                 std::round(step * std::pow(10.0, digits))) > 1e-9)
    ++digits;
  return num(v, digits);
}

}  // namespace

std::vector<double> nice_ticks(double lo, double hi, int count) {
  std::vector<double> ticks;
  if (!(hi > lo) || count < 2) {
    ticks.push_back(lo);
    return ticks;
  }
  const double raw = (hi - lo) / double(count - 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  for (double t = std::ceil(lo / step - 1e-9) * step; t <= hi + step * 1e-9; t += step)
    ticks.push_back(std::fabs(t) < step * 1e-9 ? 0.0 : t);
  return ticks;
}

std::string render_svg(const LinePlot& plot) {
  const double W = plot.width, H = plot.height;
  const double left = 70, right = 180, top = 40, bottom = 50;
  const double pw = W - left - right, ph = H - top - bottom;
  size_t n = 0;
  double ylo = std::isnan(plot.y_min) ? HUGE_VAL : plot.y_min, yhi = -HUGE_VAL;
  for (const PlotSeries& s : plot.series) {
    n = std::max(n, s.y.size());
    for (double v : s.y)
      if (std::isfinite(v)) {
        ylo = std::min(ylo, v);
        yhi = std::max(yhi, v);
      }
  }
  if (!std::isfinite(ylo) || !std::isfinite(yhi)) ylo = 0, yhi = 1;
  if (yhi - ylo < 1e-9) yhi = ylo + 1;
  const double pad = 0.05 * (yhi - ylo);
  if (std::isnan(plot.y_min)) ylo -= pad;
  yhi += pad;
  const double xlo = plot.x0, xhi = plot.x0 + plot.dx * double(std::max<size_t>(n, 2) - 1);
  auto X = [&](double x) { return left + (x - xlo) / (xhi - xlo) * pw; };
  auto Y = [&](double y) { return top + (yhi - y) / (yhi - ylo) * ph; };

  std::ostringstream o;
  o << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    << "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"" << W << "\" height=\""
    << H << "\" viewBox=\"0 0 " << W << " " << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
    << "<rect x=\"0\" y=\"0\" width=\"" << W << "\" height=\"" << H << "\" fill=\"white\"/>\n"
    << "<text x=\"" << num(left + pw / 2) << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">"
    << escape(plot.title) << "</text>\n";
  // grid and ticks
  const std::vector<double> yt = nice_ticks(ylo, yhi, 6);
  const double ystep = yt.size() > 1 ? yt[1] - yt[0] : 1.0;
  for (double t : yt) {
    o << "<line x1=\"" << num(left) << "\" y1=\"" << num(Y(t)) << "\" x2=\"" << num(left + pw)
      << "\" y2=\"" << num(Y(t)) << "\" stroke=\"#e0e0e0\"/>\n"
      << "<text x=\"" << num(left - 6) << "\" y=\"" << num(Y(t) + 4) << "\" text-anchor=\"end\">"
      << tick_label(t, ystep) << "</text>\n";
  }
  const std::vector<double> xt = nice_ticks(xlo, xhi, 8);
  const double xstep = xt.size() > 1 ? xt[1] - xt[0] : 1.0;
  for (double t : xt)
    o << "<line x1=\"" << num(X(t)) << "\" y1=\"" << num(top + ph) << "\" x2=\"" << num(X(t))
      << "\" y2=\"" << num(top + ph + 5) << "\" stroke=\"black\"/>\n"
      << "<text x=\"" << num(X(t)) << "\" y=\"" << num(top + ph + 18)
      << "\" text-anchor=\"middle\">" << tick_label(t, xstep) << "</text>\n";
  o << "<rect x=\"" << num(left) << "\" y=\"" << num(top) << "\" width=\"" << num(pw)
    << "\" height=\"" << num(ph) << "\" fill=\"none\" stroke=\"black\"/>\n"
    << "<text x=\"" << num(left + pw / 2) << "\" y=\"" << num(H - 10)
    << "\" text-anchor=\"middle\">" << escape(plot.x_label) << "</text>\n"
    << "<text transform=\"translate(18," << num(top + ph / 2)
    << ") rotate(-90)\" text-anchor=\"middle\">" << escape(plot.y_label) << "</text>\n";
  // series
  for (size_t k = 0; k < plot.series.size(); ++k) {
    const PlotSeries& s = plot.series[k];
    const std::string color = s.color.empty() ? kPalette[k % std::size(kPalette)] : s.color;
    o << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"1.4\" points=\"";
    bool first = true;
    for (size_t i = 0; i < s.y.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      o << (first ? "" : " ") << num(X(plot.x0 + plot.dx * double(i)), 1) << ","
        << num(Y(s.y[i]), 1);
      first = false;
    }
    o << "\"/>\n";
    const double ly = top + 10 + 20.0 * double(k);
    o << "<line x1=\"" << num(left + pw + 12) << "\" y1=\"" << num(ly) << "\" x2=\""
      << num(left + pw + 36) << "\" y2=\"" << num(ly) << "\" stroke=\"" << color
      << "\" stroke-width=\"2\"/>\n"
      << "<text x=\"" << num(left + pw + 42) << "\" y=\"" << num(ly + 4) << "\">" << escape(s.label)
      << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

void write_svg(const LinePlot& plot, const std::string& path) {
  write_file(path, render_svg(plot));
}

}  // namespace moe_echo::offline
