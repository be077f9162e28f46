// Files (moe_echo/host_io.hpp): what is written reads back, and every failure (a missing folder,
// a folder given as a file, a full device, a missing file) throws FileError naming the path and
// the system's reason; the pre-run checks name the option.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

#include "moe_echo/error.hpp"
#include "moe_echo/host_io.hpp"

namespace moe_echo {
namespace {

std::string scratch(const std::string& name) {
  const char* tmp = std::getenv("TMPDIR");
  return std::string(tmp && *tmp ? tmp : "/tmp") + "/moe_echo_host_files_" +
         std::to_string(::getpid()) + "_" + name;
}

// The message of the FileError `f` throws, checked to name `path` and `reason`.
void expect_file_error(const std::function<void()>& f, const std::string& verb,
                       const std::string& path, const std::string& reason) {
  try {
    f();
    ADD_FAILURE() << "no error for " << path;
  } catch (const FileError& e) {
    EXPECT_EQ(e.path(), path);
    EXPECT_EQ(e.reason(), reason);
    EXPECT_EQ(std::string(e.what()), "cannot " + verb + " '" + path + "': " + reason);
  }
}

TEST(HostFiles, WrittenBytesReadBack) {
  const std::string path = scratch("round_trip.bin");
  std::string bytes = "line 1\n";
  bytes.push_back('\0');
  bytes += std::string(100000, 'x');  // more than one read buffer
  write_file(path, bytes);
  EXPECT_EQ(read_file(path), bytes);
  {
    OutputFile f(path);
    f.write("a");
    f.write("");
    f.write("bc");
    f.close();
    f.close();  // a second close does nothing
  }
  EXPECT_EQ(read_file(path), "abc");
  write_file(path, "");
  EXPECT_EQ(read_file(path), "");
  std::remove(path.c_str());
}

TEST(HostFiles, FailuresNameThePathAndTheReason) {
  const std::string missing_dir = "/no/such/folder/out.json";
  expect_file_error([&] { write_file(missing_dir, "{}"); }, "write", missing_dir,
                    "No such file or directory");
  expect_file_error([&] { OutputFile f(missing_dir); }, "write", missing_dir,
                    "No such file or directory");
  expect_file_error([&] { read_file(missing_dir); }, "read", missing_dir,
                    "No such file or directory");
  expect_file_error([] { read_file("/"); }, "read", "/", "Is a directory");
  if (::geteuid() != 0)  // root may write anywhere
    expect_file_error([] { write_file("/proc/version", "x"); }, "write", "/proc/version",
                      "Permission denied");
  if (::access("/dev/full", W_OK) == 0) {
    // A full device: the write is buffered, and the failure shows when it is flushed at close.
    expect_file_error([] { write_file("/dev/full", std::string(10, 'x')); }, "write", "/dev/full",
                      "No space left on device");
    expect_file_error(
        [] {
          OutputFile f("/dev/full");
          f.write(std::string(1 << 20, 'x'));  // past stdio's buffer: fails in write()
          f.close();
        },
        "write", "/dev/full", "No space left on device");
  }
}

TEST(HostFiles, OutputChecksNameTheOption) {
  auto rejected = [](const std::function<void()>& f, const std::string& want) {
    try {
      f();
      ADD_FAILURE() << "no error, want " << want;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  EXPECT_NO_THROW(check_output_path("json", ""));
  EXPECT_NO_THROW(check_output_path("json", scratch("new.json")));
  rejected([] { check_output_path("json", "/no/such/folder/r.json"); },
           "json = '/no/such/folder/r.json' is invalid: allowed a path in an existing folder");
  rejected([] { check_output_path("out", "/"); }, "out = '/' is invalid: allowed a file path");
  EXPECT_NO_THROW(check_output_dir("dump", "/tmp"));
  rejected([] { check_output_dir("dump", "/no/such/folder"); },
           "dump = '/no/such/folder' is invalid: allowed an existing folder");
  rejected([] { check_output_dir("dump", "/proc/version"); },
           "dump = '/proc/version' is invalid: allowed an existing folder");
}

}  // namespace
}  // namespace moe_echo
