// MoeConfig's and EchoConfig's fields by name, from their lists (moe_echo/config_fields.hpp):
// each field's text form, what its rule allows in words, and the per-field checks validate() runs
// before its combinations (core/field_checks.hpp).
//
// A field's text is the one form the CLI's options and the Python binding's keywords share: a
// number written whole (from_chars: no trailing characters, no wrapping, finite), "true"/"false"
// (also "on"/"off", "1"/"0"), an enum's name (EnumNames), or fp8_gemms' "all" or list. Parsing a
// text checks only that it is a value of the field's type; the rule's range is validate()'s, so
// that a config built in C++ and one built from text are refused by the same words.
#include <charconv>
#include <cmath>
#include <functional>
#include <iterator>
#include <limits>
#include <sstream>
#include <type_traits>

#include "core/field_checks.hpp"
#include "moe_echo/config.hpp"
#include "moe_echo/error.hpp"

namespace moe_echo {
namespace {

// top_k's rule states kMaxTopK in words.
static_assert(kMaxTopK == 32, "config_fields.hpp: top_k's by_hand text names 32");

// "a", "a or b", "a, b or c".
std::string or_list(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) s += i + 1 == names.size() ? " or " : ", ";
    s += names[i];
  }
  return s;
}

// A bound in a message: "0", "1024", "1e6", "2147483647" (an integer the short form would round
// is written whole).
std::string bound_text(double v) {
  std::ostringstream s;
  s << v;
  const std::string t = s.str();  // "1e+06": the exponent without its sign (when +) and zeros
  if (std::stod(t) != v && v == std::floor(v) && std::fabs(v) < 9e15)
    return std::to_string(int64_t(v));
  const size_t e = t.find('e');
  if (e == std::string::npos) return t;
  size_t digits = e + 1;
  const bool negative = t[digits] == '-';
  if (t[digits] == '+' || negative) ++digits;
  while (digits + 1 < t.size() && t[digits] == '0') ++digits;
  return t.substr(0, e + 1) + (negative ? "-" : "") + t.substr(digits);
}

template <class T>
std::vector<std::string> choices_of() {
  if constexpr (std::is_enum_v<T>) {
    return {std::begin(EnumNames<T>::names), std::end(EnumNames<T>::names)};
  } else {
    return {};
  }
}

template <class T>
const char* type_name(const FieldRule& r) {
  if constexpr (std::is_same_v<T, bool>) return "bool";
  if constexpr (std::is_enum_v<T>) return "str";
  if constexpr (std::is_floating_point_v<T>) return "float";
  return r.kind == FieldRule::fp8_gemm_set ? "str" : "int";
}

// What the rule allows, in words.
template <class T>
std::string allowed_text(const char* name, const FieldRule& r) {
  switch (r.kind) {
    case FieldRule::flag: return "true or false";
    case FieldRule::choice: return or_list(choices_of<T>());
    case FieldRule::fp8_gemm_set: return kFp8GemmsAllowed;
    case FieldRule::by_hand: return r.text;
    case FieldRule::number: break;
  }
  const bool no_hi = std::isinf(r.hi);
  if constexpr (std::is_floating_point_v<T>) {
    if (no_hi)
      return std::string("a finite value ") + (r.lo_open ? "> " : ">= ") + bound_text(r.lo);
    return std::string("a finite value in ") + (r.lo_open ? "(" : "[") + bound_text(r.lo) + ", " +
           bound_text(r.hi) + "]";
  } else {
    if (no_hi) return std::string(name) + (r.lo_open ? " > " : " >= ") + bound_text(r.lo);
    return bound_text(r.lo) + (r.lo_open ? " < " : " <= ") + name + " <= " + bound_text(r.hi);
  }
}

template <class T>
std::string to_text(const T& v, const FieldRule& r) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_enum_v<T>) {
    const int i = int(v);
    return i >= 0 && i < int(std::size(EnumNames<T>::names)) ? EnumNames<T>::names[i]
                                                             : std::to_string(i);
  } else if constexpr (std::is_floating_point_v<T>) {
    char buf[64];
    const auto res = std::to_chars(buf, buf + sizeof buf, v);  // shortest exact form
    return std::string(buf, res.ptr);
  } else {
    if (r.kind == FieldRule::fp8_gemm_set) return fp8_gemms_to_string(uint32_t(v));
    return std::to_string(v);
  }
}

template <class T>
void from_text(T& v, const std::string& text, const FieldRule& r, const std::string& param) {
  if constexpr (std::is_same_v<T, bool>) {
    if (text == "true" || text == "on" || text == "1") {
      v = true;
    } else if (text == "false" || text == "off" || text == "0") {
      v = false;
    } else {
      reject(param, "'" + text + "'", "true or false (on or off)");
    }
  } else if constexpr (std::is_enum_v<T>) {
    const std::vector<std::string> names = choices_of<T>();
    for (size_t i = 0; i < names.size(); ++i)
      if (text == names[i]) {
        v = T(i);
        return;
      }
    reject(param, "'" + text + "'", or_list(names));
  } else {
    if constexpr (std::is_same_v<T, uint32_t>) {
      if (r.kind == FieldRule::fp8_gemm_set) {
        v = parse_fp8_gemms(text, param.c_str());
        return;
      }
    }
    const char *begin = text.data(), *end = text.data() + text.size();
    T parsed{};
    const auto [ptr, ec] = std::from_chars(begin, end, parsed);
    bool ok = ec == std::errc() && ptr == end && !text.empty();
    if constexpr (std::is_floating_point_v<T>) ok = ok && std::isfinite(parsed);
    if (!ok) reject(param, "'" + text + "'", number_kind<T>());
    v = parsed;
  }
}

// The rule's check of one value; by_hand rules are config.cpp's.
template <class T>
void check_value(const char* name, const T& v, const FieldRule& r) {
  switch (r.kind) {
    case FieldRule::number:
      if constexpr (std::is_arithmetic_v<T>) {
        const double d = double(v);
        const bool above_lo = r.lo_open ? d > r.lo : d >= r.lo;
        if (!std::isfinite(d) || !above_lo || d > r.hi) reject(name, v, allowed_text<T>(name, r));
      }
      return;
    case FieldRule::choice:
      if constexpr (std::is_enum_v<T>) {
        if (int(v) < 0 || int(v) >= int(std::size(EnumNames<T>::names)))
          reject(name, int(v), allowed_text<T>(name, r));
      }
      return;
    case FieldRule::fp8_gemm_set:
      if constexpr (std::is_integral_v<T>) {
        if (v == 0 || (uint32_t(v) & ~fp8_gemm::all) != 0)
          reject(name, v,
                 "a non-empty set of the six fp8_gemm bits (1 to 63; 'all' or a list in text)");
      }
      return;
    case FieldRule::flag:
    case FieldRule::by_hand: return;
  }
}

// One field of Config: its description and its value as text, through a member pointer.
template <class Config>
struct FieldOps {
  ConfigField info;
  std::function<std::string(const Config&)> get;
  std::function<void(Config&, const std::string&, const std::string&)> set;
  std::function<void(const Config&)> check;
};

template <class Config, class T>
FieldOps<Config> field_ops(const char* name, T Config::*member, FieldRule rule, const char* help) {
  FieldOps<Config> f;
  f.info = ConfigField{name,
                       type_name<T>(rule),
                       to_text(Config{}.*member, rule),
                       allowed_text<T>(name, rule),
                       choices_of<T>(),
                       help};
  f.get = [member, rule](const Config& c) { return to_text(c.*member, rule); };
  f.set = [member, rule](Config& c, const std::string& text, const std::string& param) {
    from_text(c.*member, text, rule, param);
  };
  f.check = [name, member, rule](const Config& c) { check_value(name, c.*member, rule); };
  return f;
}

const std::vector<FieldOps<MoeConfig>>& moe_ops() {
  using namespace field_rules;
#define MOE_ECHO_FIELD_OPS(type, name, default_value, rule, help) \
  field_ops(#name, &MoeConfig::name, rule, help),
  static const std::vector<FieldOps<MoeConfig>> ops = {
      MOE_ECHO_MOE_CONFIG_FIELDS(MOE_ECHO_FIELD_OPS)};
#undef MOE_ECHO_FIELD_OPS
  return ops;
}

const std::vector<FieldOps<EchoConfig>>& echo_ops() {
  using namespace field_rules;
#define MOE_ECHO_FIELD_OPS(type, name, default_value, rule, help) \
  field_ops(#name, &EchoConfig::name, rule, help),
  static const std::vector<FieldOps<EchoConfig>> ops = {
      MOE_ECHO_ECHO_CONFIG_FIELDS(MOE_ECHO_FIELD_OPS)};
#undef MOE_ECHO_FIELD_OPS
  return ops;
}

template <class Config>
std::vector<ConfigField> infos(const std::vector<FieldOps<Config>>& ops) {
  std::vector<ConfigField> out;
  for (const FieldOps<Config>& f : ops) out.push_back(f.info);
  return out;
}

template <class Config>
const FieldOps<Config>& find(const std::vector<FieldOps<Config>>& ops, std::string_view name,
                             const char* config) {
  for (const FieldOps<Config>& f : ops)
    if (name == f.info.name) return f;
  std::vector<std::string> names;
  for (const FieldOps<Config>& f : ops) names.push_back(f.info.name);
  reject("field", "'" + std::string(name) + "'",
         std::string("a field of ") + config + ": " + or_list(names));
}

}  // namespace

const std::vector<ConfigField>& moe_config_fields() {
  static const std::vector<ConfigField> fields = infos(moe_ops());
  return fields;
}

const std::vector<ConfigField>& echo_config_fields() {
  static const std::vector<ConfigField> fields = infos(echo_ops());
  return fields;
}

std::string field_text(const MoeConfig& m, std::string_view name) {
  return find(moe_ops(), name, "MoeConfig").get(m);
}

std::string field_text(const EchoConfig& e, std::string_view name) {
  return find(echo_ops(), name, "EchoConfig").get(e);
}

void set_field(MoeConfig& m, std::string_view name, const std::string& text,
               const std::string& param) {
  find(moe_ops(), name, "MoeConfig").set(m, text, param);
}

void set_field(EchoConfig& e, std::string_view name, const std::string& text,
               const std::string& param) {
  find(echo_ops(), name, "EchoConfig").set(e, text, param);
}

void check_fields(const MoeConfig& m) {
  for (const FieldOps<MoeConfig>& f : moe_ops()) f.check(m);
}

void check_fields(const EchoConfig& e) {
  for (const FieldOps<EchoConfig>& f : echo_ops()) f.check(e);
}

}  // namespace moe_echo
