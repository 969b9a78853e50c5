/* The installed header; its directory comes from `pkg-config --cflags nanoinfer`. */
#include <nanoinfer.h>
