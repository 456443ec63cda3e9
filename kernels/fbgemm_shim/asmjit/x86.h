// See core.h beside it.
#pragma once

#include "core.h"
