// The per-field checks of the config field lists (config_fields.hpp's rule column), which
// validate() runs before its checks of combinations (config.cpp).
#pragma once

#include "moe_echo/config.hpp"

namespace moe_echo {

// Throws ConfigError for the first field, in list order, that its rule refuses.
void check_fields(const MoeConfig& m);
void check_fields(const EchoConfig& e);

}  // namespace moe_echo
